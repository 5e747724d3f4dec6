"""The session page's edit box end to end (issue 21): `dex-tasks api` and a worker as real
processes, the page in headless Chromium (Debian's package, driven by Playwright). A person
edits a refund's arguments, approves, and the tool runs once with the edited ones.

The page's hooks this relies on: ``#pending`` and ``#decided`` (the card lists), a card's
``data-interrupt-id``, and in a card ``details.edit`` (its ``summary`` opens it),
``.edit-args``, ``button.approve``, ``.call-status``, ``.edited`` and ``.outcome``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.tokens import issue_token
from tests.browser import ApiProcess, api_process, chromium_page, playwright_or_skip
from tests.conftest import StartWorker
from workers import ledger

SESSION = "sess-edit"
ASKED = {"charge_id": "ch_2001", "amount_cents": 4599}
EDITED = {"charge_id": "ch_2001", "amount_cents": 1200}

playwright_sync = playwright_or_skip()


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    with api_process(env, tmp_path) as process:
        yield process


def test_person_edits_the_arguments_in_the_browser_and_the_tool_runs_them_once(
    api: ApiProcess, client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker(concurrency=1)  # publishes refund_payment and wire_transfer
    refund = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                              tool="refund_payment", arguments=ASKED)
    wire = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c2",
                            tool="wire_transfer", arguments={"account": "DE89",
                                                             "amount_cents": 100})
    assert refund.interrupt_id and wire.interrupt_id
    token = issue_token("test-secret-key", SESSION, approver="alice")

    with chromium_page(playwright_sync, f"{api.url}/sessions/{SESSION}?token={token}") as (
            page, errors):
        expect = playwright_sync.expect
        card = page.locator(f'#pending [data-interrupt-id="{refund.interrupt_id}"]')
        expect(card).to_be_visible()
        # A call of several approvers may be edited too (the edit restarts its count)
        wire_card = page.locator(f'#pending [data-interrupt-id="{wire.interrupt_id}"]')
        expect(wire_card.locator("details.edit")).to_be_visible()

        # When the person opens the edit box, changes the amount and approves
        card.locator("details.edit summary").click()
        box = card.locator(".edit-args")
        expect(box).to_be_visible()
        assert json.loads(box.input_value()) == ASKED  # prefilled with the model's
        box.fill(json.dumps(EDITED, indent=2))
        card.locator("button.approve").click()

        # Then the card moves to the decided list, says it was edited, and shows the result
        # of the edited refund
        done = page.locator(f'#decided [data-interrupt-id="{refund.interrupt_id}"]')
        expect(done.locator(".call-status")).to_have_text("succeeded", timeout=20_000)
        expect(done.locator(".edited")).to_be_visible()
        expect(done.locator(".edited")).to_contain_text("4599")
        expect(done.locator(".outcome")).to_contain_text('"refunded_cents": 1200')
        assert errors == []

    # The store agrees: the tool ran once, with the edited arguments, under the call's key
    record = client.get_tool_call(refund.key)
    assert record.status is CallStatus.SUCCEEDED
    assert (record.arguments, record.original_arguments) == (EDITED, ASKED)
    assert ledger.executions(ledger_path) == {refund.key: 1}


def test_the_pending_card_redraws_another_approvers_edit_and_approves_what_it_shows(
    api: ApiProcess, client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Issue 28 item 3: the second approver's card showed 100 after the first edited it to
    # 1,000,000, and their approval counted for the edit.
    start_worker(concurrency=1)  # publishes wire_transfer (two approvals, payments.approve)
    session = "sess-redraw"
    wire = client.call_tool(session_id=session, turn_id="t1", tool_call_id="c1",
                            tool="wire_transfer", arguments={"account": "DE89",
                                                             "amount_cents": 100})
    assert wire.interrupt_id
    token = issue_token("test-secret-key", session, approver="bob",
                        permissions=("operate", "payments.approve"))
    with chromium_page(playwright_sync, f"{api.url}/sessions/{session}?token={token}") as (
            page, errors):
        expect = playwright_sync.expect
        card = page.locator(f'#pending [data-interrupt-id="{wire.interrupt_id}"]')
        expect(card.locator(".args")).to_contain_text('"amount_cents": 100')
        # When another approver edits the amount while bob's card is open
        assert client.resolve_interrupt(session, wire.interrupt_id, True, approver="alice",
                                        permissions=["payments.approve"],
                                        arguments={"account": "DE89",
                                                   "amount_cents": 1_000_000})
        # Then the card redraws the arguments it approves, and says they changed
        expect(card.locator(".args")).to_contain_text('"amount_cents": 1000000',
                                                      timeout=20_000)
        expect(card.locator(".note")).to_contain_text("arguments changed")
        # And bob's approval is of that version: it decides, and the edited transfer runs
        card.locator("button.approve").click()
        done = page.locator(f'#decided [data-interrupt-id="{wire.interrupt_id}"]')
        expect(done.locator(".call-status")).to_have_text("succeeded", timeout=20_000)
        assert errors == []
    record = client.get_tool_call(wire.key)
    assert record.arguments == {"account": "DE89", "amount_cents": 1_000_000}
    assert ledger.executions(ledger_path) == {wire.key: 1}


def test_the_decided_cards_edit_note_escapes_bidi_characters(
    api: ApiProcess, client: DexClient, start_worker: StartWorker,
) -> None:
    # Issue 28 item 12: the model's arguments in the edit note showed a raw U+202E, which
    # reverses the text after it on screen.
    start_worker(concurrency=1)
    session = "sess-bidi"
    asked = {"charge_id": "ch_\u202e1002", "amount_cents": 4599}
    refund = client.call_tool(session_id=session, turn_id="t1", tool_call_id="c1",
                              tool="refund_payment", arguments=asked)
    assert refund.interrupt_id
    assert client.resolve_interrupt(session, refund.interrupt_id, True, approver="alice",
                                    arguments={"charge_id": "ch_1002", "amount_cents": 10})
    assert client.wait(refund.key, 30).status is CallStatus.SUCCEEDED
    token = issue_token("test-secret-key", session, approver="bob")
    with chromium_page(playwright_sync, f"{api.url}/sessions/{session}?token={token}") as (
            page, errors):
        expect = playwright_sync.expect
        note = page.locator(f'#decided [data-interrupt-id="{refund.interrupt_id}"] .edited')
        expect(note).to_contain_text("ch_\\u202e1002")
        assert "\u202e" not in (note.text_content() or "")
        assert errors == []
