"""Leases under load: a slow but live call is never reaped; a dead worker's lease runs out.

The lease of a running call is renewed by the worker's main process
(``dex_tasks.worker.hooks``), not by the child that runs the tool, so a tool that holds the GIL
or a machine busy with other work must not make a live call look lost. The reaper runs every 0.2
s here, far more often than beat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    CallStatus,
    DexClient,
    DexSettings,
    ToolCallRecord,
)
from dex_tasks.broker.runs import RUNS_KEY
from tests.conftest import StartWorker, fast_settings
from tests.helpers import wait_until
from workers import ledger

TOOLS = "workers.example_tools,chaos.tools"
LEASE = 2.0


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    # A 2 s lease, renewed every 0.67 s: short enough that any gap in renewal shows.
    return fast_settings(redis_url, sqlite_url, lease_seconds=LEASE)


def _call(client: DexClient, call_id: str, tool: str, **arguments: object) -> str:
    return client.call_tool(session_id="s", turn_id="t", tool_call_id=call_id, tool=tool,
                            arguments=arguments).key


def _ran_for(client: DexClient, record: ToolCallRecord) -> float:
    """Seconds from the call's (last) start to its end, from its events."""
    events = client.store.events_for_call(record.key)
    started = [e.created_at for e in events if e.event == "tool_call_started"][-1]
    ended = [e.created_at for e in events if e.event == "tool_call_finished"][-1]
    return ended - started


def test_tool_holding_the_gil_past_its_lease_is_not_reaped(
    client: DexClient, start_worker: StartWorker, sweeping: list[int], ledger_path: Path
) -> None:
    # Given a lease of 2 s and a tool that holds its process's GIL for 2.5-5 s in one C call
    lease = client.settings.lease_seconds
    start_worker(concurrency=2, tools=TOOLS)
    key = _call(client, "hog", "gil_hog", seconds=lease + 0.5)

    # When it runs while the reaper sweeps every 0.2 s
    final = client.wait(key, 60)

    # Then the call succeeds on its first attempt: the lease never ran out
    assert final.status is CallStatus.SUCCEEDED, final.error
    assert final.attempts == 1
    assert final.result["stall"] > lease, "the tool did not really hold the GIL past the lease"
    assert _ran_for(client, final) > lease
    assert ledger.executions(ledger_path)[key] == 1
    assert sum(sweeping) == 0 and len(sweeping) > 10


def test_slow_call_on_a_loaded_machine_is_not_reaped(
    client: DexClient, start_worker: StartWorker, sweeping: list[int], ledger_path: Path
) -> None:
    # Given a machine whose every core is busy with other processes (3 burners per core)
    lease = client.settings.lease_seconds
    start_worker(concurrency=2, tools=TOOLS)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(3 * _cores())]
    try:
        # When a CPU-bound tool and a sleeping one run there, slowed well past the lease
        # CPU work longer than 1.5 leases even on an idle machine, so the check below holds.
        cpu = _call(client, "cpu", "cpu_work", cpu_seconds=lease * 1.6)
        sleepy = _call(client, "sleepy", "lookup_order", order_id="1001", sleep=lease * 2)
        finals = [client.wait(cpu, 60), client.wait(sleepy, 60)]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)

    # Then both succeed on their first attempt while the reaper swept all along
    for final in finals:
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
        assert _ran_for(client, final) > lease * 1.5, "the call was not slower than its lease"
        assert ledger.executions(ledger_path)[final.key] == 1
    assert sum(sweeping) == 0 and len(sweeping) > 10


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def test_dead_workers_lease_runs_out_and_the_reaper_finishes_its_calls(
    client: DexClient, start_worker: StartWorker, sweeping: list[int], ledger_path: Path,
    redis_url: str,
) -> None:
    # Given a worker running a single-attempt charge and a retrying read, both for a minute
    lease = client.settings.lease_seconds
    doomed = start_worker(concurrency=2, tools=TOOLS)
    charge = _call(client, "charge", "charge_card", customer_id="cu_1", amount_cents=100,
                   sleep=60)
    read = _call(client, "read", "stall_first_attempt", order_id="1001", sleep=60)
    wait_until(lambda: all(client.get_tool_call(k).status is CallStatus.RUNNING
                           for k in (charge, read)), 20, "both calls to run")
    wait_until(lambda: len(ledger.read(ledger_path)) == 2, 20, "both tools to start")

    # When the whole worker disappears (main process and children), and another one is there
    # (the charge's lease is in the store; the read's, a retrying call's, in Redis: DESIGN v4)
    leases = {charge: client.store.get_call(charge).lease_expires_at,
              read: redis.Redis.from_url(redis_url).zscore(RUNS_KEY, read)}
    doomed.kill_all()
    killed_at = time.time()
    start_worker(concurrency=2, tools=TOOLS)

    # Then nothing is reaped before its lease ran out, and both are finished soon after:
    # the charge cannot be retried, so its outcome is unknown; the read runs again elsewhere.
    lost = client.wait(charge, lease + 15)
    assert lost.status is CallStatus.OUTCOME_UNKNOWN
    assert lost.error is not None and lost.error.startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "lease" in lost.error
    retried = client.wait(read, lease + 20)
    assert retried.status is CallStatus.SUCCEEDED and retried.attempts == 2
    for key in (charge, read):
        reaped = [e for e in client.store.events_for_call(key)
                  if e.from_status == "running" and e.created_at > killed_at]
        assert reaped, f"{key} was not moved by the reaper"
        lease_end = leases[key]
        assert lease_end is not None and reaped[0].created_at >= lease_end
        assert reaped[0].created_at - killed_at < lease + 5
    runs = ledger.executions(ledger_path)
    assert runs[charge] == 1 and runs[read] == 2
