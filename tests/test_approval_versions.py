"""Issue 28 item 3: an approval names the version of the arguments it approves.

Two approvers of a wire transfer (two approvals holding ``payments.approve``): the first edits
the amount 100 -> 1,000,000 while the second's card still shows 100. The second's approval of
what they saw is refused, saying the arguments changed, and counts for nothing; an approval
that names the current version counts. Real worker, real Redis; the HTTP API in-process.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from dex_tasks import CallStatus, DexClient, DexSettings, StaleApprovalError
from dex_tasks.api import create_api
from dex_tasks.arguments import arguments_version
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker
from workers import ledger

PERM = ["payments.approve"]
ASKED = {"account": "DE89", "amount_cents": 100}
EDITED = {"account": "DE89", "amount_cents": 1_000_000}


def _pending(client: DexClient, session: str, key: str) -> Any:
    (pending,) = [p for p in client.get_agent_snapshot(session).pending_interrupts
                  if p.key == key]
    return pending


def test_a_stale_approval_is_refused_and_counts_for_nothing(
    start_worker: StartWorker, client: DexClient, settings: DexSettings, ledger_path: Any,
) -> None:
    start_worker()  # publishes wire_transfer
    wire = client.call_tool(session_id="s-ver", turn_id="t1", tool_call_id="c1",
                            tool="wire_transfer", arguments=ASKED)
    assert wire.interrupt_id is not None
    # Given what both approvers were shown: the model's arguments and their version
    seen = _pending(client, "s-ver", wire.key)
    assert seen.arguments_version == arguments_version(ASKED)
    # When the first approver edits the amount (their approval counts for the edited version)
    assert client.resolve_interrupt("s-ver", wire.interrupt_id, True, approver="alice",
                                    permissions=PERM, arguments=EDITED,
                                    arguments_version=seen.arguments_version)
    now = _pending(client, "s-ver", wire.key)
    assert now.arguments == EDITED and now.arguments_version != seen.arguments_version
    # Then the second approver's approval of the version they saw is refused, saying so
    with pytest.raises(StaleApprovalError, match="the arguments changed since you saw them"):
        client.resolve_interrupt("s-ver", wire.interrupt_id, True, approver="bob",
                                 permissions=PERM, arguments_version=seen.arguments_version)
    # And so is one that names no version at all, now that the arguments were edited
    with pytest.raises(StaleApprovalError, match="amount_cents 100 -> 1000000"):
        client.resolve_interrupt("s-ver", wire.interrupt_id, True, approver="bob",
                                 permissions=PERM)
    # Over HTTP too: 409 with the message; nothing counted
    token = issue_token("test-secret-key", "s-ver", approver="bob",
                        permissions=("operate", "payments.approve"))
    with TestClient(create_api(settings)) as http:
        auth = {"Authorization": f"Bearer {token}"}
        stale = http.post("/interrupts/resolve", headers=auth, json={
            "interrupt_id": wire.interrupt_id, "approved": True,
            "arguments_version": seen.arguments_version})
        assert stale.status_code == 409
        assert "the arguments changed since you saw them" in stale.json()["error"]
        assert _pending(client, "s-ver", wire.key).approved_by == ["alice"]
        assert client.get_tool_call(wire.key).status is CallStatus.AWAITING_APPROVAL
        # When bob approves the version he now sees, it counts and decides
        fresh = http.post("/interrupts/resolve", headers=auth, json={
            "interrupt_id": wire.interrupt_id, "approved": True,
            "arguments_version": now.arguments_version})
        assert fresh.json() == {"accepted": True}
    record = client.wait(wire.key, 30)
    assert record.status is CallStatus.SUCCEEDED and record.arguments == EDITED
    assert [e["key"] for e in ledger.read(ledger_path)] == [wire.key]


def test_an_unversioned_approval_of_unedited_arguments_still_counts(
    start_worker: StartWorker, client: DexClient,
) -> None:
    # The model's arguments, never edited, are what everyone was shown: an approval naming no
    # version approves them (as before), and a version that matches is accepted too.
    start_worker()
    wire = client.call_tool(session_id="s-ver2", turn_id="t1", tool_call_id="c1",
                            tool="wire_transfer", arguments=ASKED)
    assert wire.interrupt_id is not None
    assert client.resolve_interrupt("s-ver2", wire.interrupt_id, True, approver="alice",
                                    permissions=PERM)
    assert client.resolve_interrupt("s-ver2", wire.interrupt_id, True, approver="bob",
                                    permissions=PERM,
                                    arguments_version=arguments_version(ASKED))
    assert client.wait(wire.key, 30).status is CallStatus.SUCCEEDED
