"""The session page (the seeds' "Agent session" tab) in Chromium, at desktop and phone sizes.

`dex-tasks api` runs as a real process, tools run on a real worker, and a person uses the page
in headless Chromium (Debian's package, driven by Playwright): the transcript with its tool
messages, who they are working as, deadlines as clock times, read-only without `operate`,
decisions that reach the store, and the operator's list of sessions waiting.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from dex_tasks import CallStatus, DexClient, MessageRole
from dex_tasks.tokens import issue_token
from tests.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    SECRET,
    ApiProcess,
    api_process,
    horizontal_overflow,
    playwright_or_skip,
    within_viewport_width,
)
from tests.conftest import StartWorker

playwright_sync = playwright_or_skip()
expect = playwright_sync.expect

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
# A zone whose offset is not whole hours, so the page cannot pass by printing UTC.
TIMEZONE = "Asia/Kolkata"
IST = timezone(timedelta(hours=5, minutes=30))
# Long ids and a long unbroken argument: what pushes a careless layout sideways on a phone.
SESSION = "sess-page-" + "0123456789abcdef" * 3
LONG_CHARGE = "ch_" + "9f8e7d6c5b4a" * 25


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    with api_process(env, tmp_path) as process:
        yield process


@pytest.fixture
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _open(browser: Any, url: str, viewport: dict[str, int],
          loaded: bool = True) -> tuple[Any, list[str]]:
    """A fresh page at ``viewport`` in the test's time zone, collecting script errors;
    ``loaded``: wait until the session page has drawn its first snapshot."""
    context = browser.new_context(viewport=viewport, timezone_id=TIMEZONE)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(url)
    if loaded:
        expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    return page, errors


def _refund(client: DexClient, call_id: str, charge: str, amount: int,
            session: str = SESSION) -> Any:
    record = client.call_tool(session_id=session, turn_id="t2", tool_call_id=call_id,
                              tool="refund_payment",
                              arguments={"charge_id": charge, "amount_cents": amount},
                              approval_deadline=900)
    assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
    return record


def _ist_clock(moment: datetime) -> str:
    """How the page must print ``moment`` to a reader in TIMEZONE."""
    return moment.astimezone(IST).strftime("%Y-%m-%d %H:%M:%S") + " UTC+05:30"


def _deadline(client: DexClient, interrupt_id: str, session: str = SESSION) -> datetime:
    [pending] = [p for p in client.get_agent_snapshot(session).pending_interrupts
                 if p.interrupt_id == interrupt_id]
    assert pending.deadline is not None
    return pending.deadline


def _check_layout(page: Any, shot: Path) -> None:
    page.screenshot(path=str(shot), full_page=True)
    assert horizontal_overflow(page) == [], shot.name


def test_the_session_page_shows_the_transcript_and_decides_at_desktop_and_phone_sizes(
    api: ApiProcess, client: DexClient, start_worker: StartWorker, tmp_path: Path,
    browser: Any,
) -> None:
    # Given a session whose transcript has a user message, the model's text, a tool call that
    # succeeded and one that failed, and two refunds waiting for a decision
    start_worker(concurrency=1)
    assert client.send_user_message(SESSION, "Where is order 1001? Refund the other one.")
    client.add_assistant_message(SESSION, "t1", "Let me look the order up.")
    ok = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c-lookup",
                          tool="lookup_order", arguments={"order_id": "1001"})
    broken = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c-report",
                              tool="broken_report", arguments={"report": "q3"})
    assert client.wait(ok.key, 20).status is CallStatus.SUCCEEDED
    assert client.wait(broken.key, 20).status is CallStatus.FAILED
    approve = _refund(client, "c-refund-1-" + "x" * 40, LONG_CHARGE, 4599)
    reject = _refund(client, "c-refund-2", "ch_1002", 1250)
    deadline = _deadline(client, approve.interrupt_id)
    token = issue_token(SECRET, SESSION, approver="alice")
    url = f"{api.url}/sessions/{SESSION}?token={token}"

    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page, errors = _open(browser, url, viewport)
        # Then, before anything is clicked, it says who the reader works as
        expect(page.locator("#working-as")).to_have_text("Working as alice · operate")
        expect(page.locator("#read-only")).to_be_hidden()
        expect(page.locator("#live")).to_have_attribute("data-state", "live")

        # The transcript: user, assistant, and each tool message with its status and output
        transcript = page.locator("#transcript")
        expect(transcript.locator('[data-role="user"] .text')).to_have_text(
            "Where is order 1001? Refund the other one.")
        expect(transcript.locator('[data-role="user"] .status')).to_have_text("delivered")
        expect(transcript.locator('[data-role="assistant"] .text')).to_have_text(
            "Let me look the order up.")
        looked_up = transcript.locator(f'[data-role="tool"][data-key="{ok.key}"]')
        expect(looked_up.locator(".tool")).to_have_text("lookup_order")
        expect(looked_up.locator(".status")).to_have_text("succeeded")
        expect(looked_up.locator(".output")).to_contain_text('"status": "shipped"')
        failed = transcript.locator(f'[data-role="tool"][data-key="{broken.key}"]')
        expect(failed.locator(".status")).to_have_text("failed")
        expect(failed.locator(".output")).to_contain_text("report 'q3' does not exist")
        # The refunds waiting are not finished calls yet: listed after the transcript
        expect(page.locator(f'#in-flight [data-key="{approve.key}"] .status')).to_have_text(
            "awaiting_approval")

        # The cards: each deadline as a clock time in the reader's zone, not only a countdown
        card = page.locator(f'#pending [data-interrupt-id="{approve.interrupt_id}"]')
        expect(card.locator(".countdown")).to_contain_text("expires in 1")
        expect(card.locator(".deadline-clock")).to_have_text(_ist_clock(deadline))
        expect(card.locator(".args")).to_contain_text(LONG_CHARGE)

        # Approve and Reject are on screen as the page opens, with nothing to scroll sideways
        for button in ("button.approve", "button.reject"):
            expect(card.locator(button)).to_be_in_viewport()
            assert within_viewport_width(page, card.locator(button)), (name, button)
        _check_layout(page, tmp_path / f"session-{name}.png")
        assert errors == [], name
        if name == "desktop":
            page.context.close()

    # When the person on the phone approves one call and rejects the other with a message
    card.locator("button.approve").click()
    rejected_card = page.locator(f'#pending [data-interrupt-id="{reject.interrupt_id}"]')
    rejected_card.locator(".reject-message").fill("Refund by bank transfer instead.")
    rejected_card.locator("button.reject").click()

    # Then the decisions show on the page, and the tool messages arrive in the transcript live
    done = page.locator(f'#decided [data-interrupt-id="{approve.interrupt_id}"]')
    expect(done.locator(".call-status")).to_have_text("succeeded", timeout=20_000)
    expect(done.locator(".who")).to_contain_text("approved by alice")
    expect(done.locator(".deadline-clock")).to_have_text(_ist_clock(deadline))
    refunded = page.locator(f'#transcript [data-role="tool"][data-key="{approve.key}"]')
    expect(refunded.locator(".status")).to_have_text("succeeded", timeout=20_000)
    expect(refunded.locator(".output")).to_contain_text('"refunded_cents": 4599')
    refused = page.locator(f'#transcript [data-role="tool"][data-key="{reject.key}"]')
    expect(refused.locator(".status")).to_have_text("rejected")
    expect(refused.locator(".output")).to_contain_text("Refund by bank transfer instead.")
    expect(page.locator("#pending .card")).to_have_count(0)
    expect(page.locator("#in-flight li")).to_have_count(0)
    _check_layout(page, tmp_path / "session-phone-decided.png")
    assert errors == []

    # And the store agrees: both decided by alice, one ran, one was rejected with the message
    assert client.get_tool_call(approve.key).status is CallStatus.SUCCEEDED
    assert "Refund by bank transfer instead." in (client.get_tool_call(reject.key).error or "")
    snapshot = client.get_agent_snapshot(SESSION)
    assert {d.interrupt_id: d.decided_by for d in snapshot.decided} \
        == {approve.interrupt_id: "alice", reject.interrupt_id: "alice"}
    tool_keys = [m.key for m in snapshot.messages if m.role is MessageRole.TOOL]
    assert sorted(tool_keys) == sorted([ok.key, broken.key, approve.key, reject.key])


def test_a_view_token_sees_the_session_read_only(
    api: ApiProcess, client: DexClient, tmp_path: Path, browser: Any
) -> None:
    # Given a call waiting, and a token with only the view permission
    record = _refund(client, "c1", LONG_CHARGE, 700)
    token = issue_token(SECRET, SESSION, approver="vic", permissions=["view"])

    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        page, errors = _open(browser, f"{api.url}/sessions/{SESSION}?token={token}", viewport)
        # Then the page says so before anything else, and offers no decision
        expect(page.locator("#working-as")).to_have_text("Working as vic · view")
        expect(page.locator("#read-only")).to_be_visible()
        expect(page.locator("#read-only")).to_contain_text("not approve or reject")
        card = page.locator(f'#pending [data-interrupt-id="{record.interrupt_id}"]')
        expect(card).to_have_attribute("data-read-only", "true")
        expect(card.locator(".note")).to_contain_text("Read-only")
        expect(card.locator("button")).to_have_count(0)
        expect(card.locator(".deadline-clock")).to_have_text(
            _ist_clock(_deadline(client, record.interrupt_id)))
        _check_layout(page, tmp_path / f"read-only-{name}.png")
        assert errors == []
        page.context.close()

    # And nothing was decided
    assert client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL
    assert client.get_agent_snapshot(SESSION).decided == []


def test_an_operator_opens_the_sessions_waiting_and_decides_in_one(
    api: ApiProcess, client: DexClient, tmp_path: Path, browser: Any
) -> None:
    # Given calls waiting in two sessions, the second requested last
    older = _refund(client, "c1", "ch_1", 100, session="sess-older")
    newer = _refund(client, "c1", LONG_CHARGE, 200, session=SESSION)
    assert older.created_at < newer.created_at
    token = issue_token(SECRET, None, approver="olga", all_sessions=True)

    page, errors = _open(browser, f"{api.url}/sessions?token={token}", PHONE, loaded=False)
    # Then the list says who is working, and shows the newest session first
    expect(page.locator("#working-as")).to_have_text(
        "Working as olga · operate · all sessions")
    rows = page.locator("#sessions .session-row")
    expect(rows).to_have_count(2)
    expect(rows.nth(0)).to_have_attribute("data-session-id", SESSION)
    expect(rows.nth(1)).to_have_attribute("data-session-id", "sess-older")
    expect(rows.nth(1).locator(".badge")).to_have_text("1 waiting")
    _check_layout(page, tmp_path / "sessions-phone.png")

    # When the operator opens the older session's page from the list and approves there
    rows.nth(1).locator("a").click()
    expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    expect(page.locator("#working-as")).to_have_text(
        "Working as olga · operate · all sessions")
    card = page.locator(f'#pending [data-interrupt-id="{older.interrupt_id}"]')
    expect(card.locator("button.approve")).to_be_in_viewport()
    card.locator("button.approve").click()
    expect(page.locator(f'#decided [data-interrupt-id="{older.interrupt_id}"] .who')) \
        .to_contain_text("approved by olga")
    assert errors == []

    # Then the store records the operator's decision, and the other session still waits
    [decided] = client.get_agent_snapshot("sess-older").decided
    assert (decided.decision, decided.decided_by) == ("approved", "olga")
    assert client.get_tool_call(newer.key).status is CallStatus.AWAITING_APPROVAL

    # A session token does not open the list: the page says what to ask for
    session_token = issue_token(SECRET, SESSION)
    page.goto(f"{api.url}/sessions?token={session_token}")
    expect(page.locator("h1")).to_have_text("Not allowed")
    expect(page.locator("body")).to_contain_text("--all-sessions")

