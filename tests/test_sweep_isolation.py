"""Sweeps never wait for tool capacity (issue 11 item 2): beat runs them in its own process.

Every worker slot is taken by tools that hang with no time limit, more calls wait behind them,
and another worker vanishes: the approval deadline and the lost worker's lease are still acted
on within a few seconds, by ``dex-tasks beat`` alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from dex_tasks import CallStatus, DexClient, ToolCallRecord
from dex_tasks.broker.runs import RUNS_KEY
from dex_tasks.store.deadlines import APPROVAL_DEADLINE_PASSED
from tests.conftest import StartWorker
from tests.helpers import started_pid, wait_until
from workers import example_tools

assert example_tools.refund_payment.name == "refund_payment"

# Beat sweeps every 0.5 s here (conftest's fast settings); "a few seconds" leaves room for a
# loaded 2-core machine.
SLACK = 3.0


def _moves(client: DexClient, key: str, source: CallStatus, to: CallStatus) -> list[float]:
    return [e.created_at for e in client.store.events_for_call(key)
            if e.from_status == source.value and e.to_status == to.value]


def _moved_at(client: DexClient, key: str, source: CallStatus, to: CallStatus) -> float:
    return _moves(client, key, source, to)[0]


def _running(client: DexClient, records: list[ToolCallRecord]) -> list[str]:
    return [r.key for r in records if client.get_tool_call(r.key).status is CallStatus.RUNNING]


def test_hung_tools_in_every_slot_delay_no_deadline_and_no_reaping(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    beat: subprocess.Popen[bytes],
) -> None:
    # Given a worker whose two slots run tools that hang with no time limit, two more such
    # calls queued behind them...
    busy = start_worker(concurrency=2)
    hung = [client.call_tool(session_id="s", turn_id="t", tool_call_id=f"hung{i}",
                             tool="charge_card" if i % 2 else "lookup_order",
                             arguments={"customer_id": "cu", "amount_cents": 1, "sleep": 600}
                             if i % 2 else {"order_id": "1001", "sleep": 600})
            for i in range(4)]
    wait_until(lambda: len(_running(client, hung)) == 2, 30, "both slots to be taken")
    in_slots = _running(client, hung)
    assert {started_pid(ledger_path, key) for key in in_slots} <= set(busy.children())
    # ...and a second worker (the only one with chaos.tools) running a call
    doomed = start_worker(concurrency=1, tools="chaos.tools")
    lost = client.call_tool(session_id="s", turn_id="t", tool_call_id="lost",
                            tool="stall_first_attempt",
                            arguments={"order_id": "1001", "sleep": 600})
    assert started_pid(ledger_path, lost.key) in doomed.children()

    # When an approval with a 2 s deadline is requested, and the second worker vanishes
    refund = client.call_tool(session_id="s", turn_id="t", tool_call_id="refund",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 5},
                              approval_deadline=2)
    deadline = refund.created_at.timestamp() + 2
    doomed.kill_all()
    # (A retrying call runs under a lease in Redis, DESIGN version 4, renewed only while its
    # worker lives: this is its last expiry, on Redis's clock, which is this machine's.)
    with redis.Redis.from_url(client.settings.redis_url) as r:
        lease_end = r.zscore(RUNS_KEY, lost.key)
    assert lease_end is not None

    # Then beat rejects the refund within a few seconds of its deadline...
    rejected = client.wait(refund.key, 2 + 10 * SLACK)
    assert rejected.status is CallStatus.REJECTED
    assert (rejected.error or "").startswith(APPROVAL_DEADLINE_PASSED)
    rejected_at = _moved_at(client, refund.key, CallStatus.AWAITING_APPROVAL,
                            CallStatus.REJECTED)
    assert deadline <= rejected_at < deadline + SLACK
    # ...and reaps the vanished worker's call within a few seconds of its lease ending
    # (Waited for on the reap's own event: the reaper takes the run from Redis a moment before
    # it records the lost attempt in the store, and the call reads queued in between.)
    wait_until(lambda: _moves(client, lost.key, CallStatus.RUNNING, CallStatus.QUEUED),
               10 * SLACK, "the lost call to be reaped")
    assert client.get_tool_call(lost.key).status is CallStatus.QUEUED
    reaped_at = _moved_at(client, lost.key, CallStatus.RUNNING, CallStatus.QUEUED)
    assert lease_end <= reaped_at < lease_end + SLACK
    print(f"\nrejected {rejected_at - deadline:.2f}s after its deadline, reaped "
          f"{reaped_at - lease_end:.2f}s after its lease ended")
    # ...while every slot of the busy worker is still inside its hung tool
    assert _running(client, hung) == in_slots
    assert all(client.get_tool_call(r.key).status is CallStatus.QUEUED
               for r in hung if r.key not in in_slots)
    assert busy.proc.poll() is None
