"""The approval page end to end: `dex-tasks api` and a worker as real processes, the page in
headless Chromium (Debian's package, driven by Playwright), a person approving and rejecting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.tokens import issue_token
from tests.browser import CHROMIUM, CHROMIUM_ARGS, ApiProcess, api_process, playwright_or_skip
from tests.conftest import StartWorker
from tests.helpers import wait_until

SESSION = "sess-page"

playwright_sync = playwright_or_skip()


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[ApiProcess]:
    with api_process(env, tmp_path) as process:
        yield process


def _refund(client: DexClient, call_id: str, charge: str, amount: int) -> tuple[str, str]:
    record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id=call_id,
                              tool="refund_payment",
                              arguments={"charge_id": charge, "amount_cents": amount},
                              approval_deadline=900)
    assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
    return record.key, record.interrupt_id


def test_person_approves_one_call_and_rejects_another_in_the_browser(
    api: ApiProcess, client: DexClient, start_worker: StartWorker, tmp_path: Path
) -> None:
    url, api_log = api.url, api.log_path
    start_worker(concurrency=1)  # publishes refund_payment to the catalog this client reads
    approve_key, approve_id = _refund(client, "c1", "ch_1001", 4599)
    reject_key, reject_id = _refund(client, "c2", "ch_1002", 1250)
    token = issue_token("test-secret-key", SESSION, approver="alice")

    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            # The page's old address (in links already handed out) redirects to the new one.
            page.goto(f"{url}/sessions/{SESSION}/approvals?token={token}")
            assert page.url == f"{url}/sessions/{SESSION}?token={token}"
            expect = playwright_sync.expect

            # Given two cards waiting, each with its tool, arguments, effect and countdown
            approve_card = page.locator(f'#pending [data-interrupt-id="{approve_id}"]')
            reject_card = page.locator(f'#pending [data-interrupt-id="{reject_id}"]')
            expect(approve_card).to_be_visible()
            expect(reject_card).to_be_visible()
            expect(approve_card.locator(".tool")).to_have_text("refund_payment")
            expect(approve_card.locator(".effect")).to_have_text("non_idempotent_write")
            expect(approve_card.locator(".args")).to_contain_text('"charge_id": "ch_1001"')
            expect(approve_card.locator(".countdown")).to_contain_text("expires in 1")
            expect(page.locator("#live")).to_have_attribute("data-state", "live")

            # When a third call arrives while the page is open, it appears without a reload
            _, late_id = _refund(client, "c3", "ch_1003", 99)
            expect(page.locator(f'#pending [data-interrupt-id="{late_id}"]')).to_be_visible()

            # When the person approves the first call
            approve_card.locator("button.approve").click()
            # Then its card moves to the decided list and shows the call succeeded
            done = page.locator(f'#decided [data-interrupt-id="{approve_id}"]')
            expect(done.locator(".call-status")).to_have_text("succeeded", timeout=20_000)
            expect(done.locator(".decision")).to_have_text("approved")
            expect(done.locator(".who")).to_contain_text("approved by alice")
            expect(done.locator(".outcome")).to_contain_text('"refunded_cents": 4599')

            # When the person rejects the second with a message
            reject_card.locator(".reject-message").fill("Refund by bank transfer instead.")
            reject_card.locator("button.reject").click()
            # Then it shows rejected, by whom, with the message
            rejected = page.locator(f'#decided [data-interrupt-id="{reject_id}"]')
            expect(rejected).to_have_attribute("data-status", "rejected")
            expect(rejected.locator(".decision")).to_have_text("rejected")
            expect(rejected.locator(".who")).to_contain_text("rejected by alice")
            expect(rejected.locator(".reason")).to_have_text("Refund by bank transfer instead.")
            expect(page.locator("#pending .card")).to_have_count(1)
            expect(page.locator("#activity li").first).to_be_visible()
            page.screenshot(path=str(tmp_path / "approvals.png"), full_page=True)
            assert errors == []

            # When the API stops while the page's stream is open, it ends the stream and exits
            # at once (not after the graceful-shutdown timeout), and the page says it lost it.
            started = time.monotonic()
            api.proc.terminate()
            api.proc.wait(10)
            assert time.monotonic() - started < 3
            expect(page.locator("#live")).not_to_have_attribute("data-state", "live")
        finally:
            browser.close()

    # The store agrees with what the page showed.
    assert client.get_tool_call(approve_key).status is CallStatus.SUCCEEDED
    rejected_call = client.get_tool_call(reject_key)
    assert rejected_call.status is CallStatus.REJECTED
    assert "Refund by bank transfer instead." in (rejected_call.error or "")
    decided = {d.interrupt_id: d for d in client.get_agent_snapshot(SESSION).decided}
    assert decided[approve_id].decided_by == decided[reject_id].decided_by == "alice"
    # The page's links carry the token in the URL; the API's log never does.
    wait_until(lambda: "/approvals" in api_log.read_text(), 5, "the access log line")
    assert token not in api_log.read_text()
