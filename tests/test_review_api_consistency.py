"""``get_agent_snapshot`` is one consistent read on PostgreSQL too: snapshots taken while
decisions commit never show a call decided in one list and still awaiting approval in another
(issue 19, finding 8: 65 contradictions in 183 snapshots under READ COMMITTED)."""

from __future__ import annotations

import threading

from dex_tasks import AgentSnapshot, CallStatus, DexClient
from tests.conftest import fast_settings
from workers import example_tools

assert example_tools.refund_payment  # registered here: call_tool validates locally

SESSION = "sess-consistent"
CALLS = 60


def contradictions(snap: AgentSnapshot) -> list[str]:
    """Every way the snapshot's lists disagree about a call."""
    status = {c.key: c.status for c in snap.tool_calls}
    pending = {p.key for p in snap.pending_interrupts}
    found = []
    for d in snap.decided:
        if status[d.key] is CallStatus.AWAITING_APPROVAL:
            found.append(f"{d.key} decided but awaiting approval in tool_calls")
        if d.call_status is not status[d.key]:
            found.append(f"{d.key}: {d.call_status} in decided, {status[d.key]} in tool_calls")
        if d.key in pending:
            found.append(f"{d.key} both pending and decided")
    for key, st in status.items():
        if st is CallStatus.REJECTED and key not in {d.key for d in snap.decided}:
            found.append(f"{key} rejected in tool_calls but not decided")
        if st is CallStatus.AWAITING_APPROVAL and key not in pending:
            found.append(f"{key} awaiting approval in tool_calls but not pending")
    return found


def test_snapshots_under_concurrent_decisions_never_contradict_themselves(
    redis_url: str, postgres_url: str
) -> None:
    with DexClient(fast_settings(redis_url, postgres_url)) as client:
        interrupts = []
        for i in range(CALLS):
            record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id=f"c{i}",
                                      tool="refund_payment",
                                      arguments={"charge_id": f"ch_{i}", "amount_cents": i + 1})
            assert record.interrupt_id is not None
            interrupts.append(record.interrupt_id)
        done = threading.Event()

        def decide() -> None:
            try:
                for interrupt_id in interrupts:
                    # Rejections: decisions that need no worker or broker.
                    assert client.resolve_interrupt(SESSION, interrupt_id, False,
                                                    rejection_message="no")
            finally:
                done.set()

        decider = threading.Thread(target=decide)
        decider.start()
        snapshots = 0
        found: list[str] = []
        while not done.is_set() or snapshots == 0:
            found += contradictions(client.get_agent_snapshot(SESSION))
            snapshots += 1
        decider.join()
        final = client.get_agent_snapshot(SESSION)
        assert len(final.decided) == CALLS and not final.pending_interrupts
        assert found == [], f"{len(found)} contradictions in {snapshots} snapshots: {found[:5]}"
