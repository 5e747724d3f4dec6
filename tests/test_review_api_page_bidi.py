"""The approval card shows bidi and control characters of a call's arguments as escapes: a
charge id of ``"\\u202e00001 :tnuoma"`` must not display as ``amount: 10000`` (issue 19,
finding 10). `dex-tasks api` as a real process, the page in headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.tokens import issue_token
from tests.browser import CHROMIUM, CHROMIUM_ARGS, ApiProcess, api_process, playwright_or_skip
from workers import example_tools

assert example_tools.refund_payment  # registered here: call_tool validates locally

SESSION = "sess-bidi"
SPOOF = "\u202e00001 :tnuoma"

playwright_sync = playwright_or_skip()


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    with api_process(env, tmp_path) as process:
        yield process


def test_the_card_shows_bidi_and_control_characters_escaped(
    api: ApiProcess, client: DexClient
) -> None:
    record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                              tool="refund_payment",
                              arguments={"charge_id": SPOOF + "\x1b[2J\u2066",
                                         "amount_cents": 1})
    assert record.status is CallStatus.AWAITING_APPROVAL
    token = issue_token("test-secret-key", SESSION, approver="alice")
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{api.url}/sessions/{SESSION}?token={token}")
            card = page.locator(f'#pending [data-interrupt-id="{record.interrupt_id}"]')
            playwright_sync.expect(card).to_be_visible()
            shown = card.locator(".args").inner_text()
            # What is there is shown, escaped; nothing reorders or controls the display
            assert "\\u202e00001 :tnuoma\\u001b[2J\\u2066" in shown, shown
            assert not any(c in shown for c in "\u202e\u2066\x1b"), ascii(shown)
            assert "amount: 10000" not in shown
        finally:
            browser.close()
