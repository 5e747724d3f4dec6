"""The threads pool (issue 12 item 2): hundreds of I/O-bound calls in flight in one process,
with every guarantee the pool can keep.

* 200 one-second calls on ``--pool threads -c 200`` finish in a few seconds, each attempt owned
  by its own thread;
* a SIGKILLed threads worker: single-attempt calls end ``outcome_unknown``, retrying calls run
  again, nothing runs twice (leases and the reaper, as on prefork);
* a hard time limit ends the call at the limit and abandons the thread (it cannot be killed);
  whatever the thread records when it finally returns is refused.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient, ToolCallRecord
from dex_tasks.broker.metrics import shown_runs
from tests.conftest import StartWorker
from tests.helpers import WorkerProcess, wait_until
from workers import example_tools, ledger

assert example_tools.lookup_order.name == "lookup_order"

TOOLS = "workers.example_tools,chaos.tools"


def _call(client: DexClient, call_id: str, tool: str, **arguments: object) -> ToolCallRecord:
    return client.call_tool(session_id="s", turn_id="t", tool_call_id=call_id, tool=tool,
                            arguments=arguments)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_two_hundred_one_second_calls_run_at_once_on_200_threads(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given one threads worker with 200 threads
    worker = start_worker(concurrency=200, pool="threads", tools=TOOLS)
    assert worker.children() == []  # one process: the threads are inside it

    # When 200 calls of a tool that waits 1 s on I/O are made
    started = time.monotonic()
    keys = [_call(client, f"c{i}", "lookup_order", order_id="1001", sleep=1.0).key
            for i in range(200)]
    finals = [client.wait(key, 60) for key in keys]
    wall = time.monotonic() - started
    rss = _rss_mb(worker.pid)
    print(f"\n200 x 1 s calls on --pool threads -c 200: {wall:.1f}s wall, worker RSS {rss:.0f} MB")

    # Then all succeed on their first attempt within a few seconds, not 200 s / slots
    assert all(f.status is CallStatus.SUCCEEDED and f.attempts == 1 for f in finals)
    assert wall < 30, f"200 one-second calls took {wall:.1f}s"
    assert rss < 500
    # Each attempt was owned by its thread (<node>:<pid>:<thread>), and many ran at once
    owners = {client.store.get_call(k).worker for k in keys}  # type: ignore[union-attr]
    assert all(o and o.startswith(f"dex-{worker.pid}@") and o.count(":") == 2 for o in owners)
    assert len(owners) >= 50, f"only {len(owners)} threads ran the 200 calls"
    assert ledger.executions(ledger_path) == dict.fromkeys(keys, 1)


def test_sigkilled_threads_worker_ends_single_attempt_calls_and_reruns_the_others(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    beat: subprocess.Popen[bytes],
) -> None:
    # Given a threads worker running five charges and five reads, each in its own thread
    doomed = start_worker(concurrency=20, pool="threads", tools=TOOLS)
    charges = [_call(client, f"charge{i}", "charge_card", customer_id=f"cu_{i}",
                     amount_cents=100 + i, sleep=600) for i in range(5)]
    reads = [_call(client, f"read{i}", "stall_first_attempt", order_id="1001", sleep=600)
             for i in range(5)]
    wait_until(lambda: len(ledger.read(ledger_path)) == 10, 30, "all ten tools to start")
    # (a charge's owner is in the store; a read's, leased in Redis: DESIGN v4)
    runs = shown_runs(client.settings)
    owners = {client.store.get_call(r.key).worker for r in charges}  # type: ignore[union-attr]
    owners |= {runs.get(r.key).worker for r in reads}  # type: ignore[union-attr]
    assert len(owners) == 10, owners

    # When the worker is SIGKILLed (one process: every thread dies with it), another is there
    doomed.kill_all()
    start_worker(concurrency=20, pool="threads", tools=TOOLS)

    # Then the charges end outcome_unknown, never run again, and the reads run again, once
    for record in charges:
        final = client.wait(record.key, 40)
        assert final.status is CallStatus.OUTCOME_UNKNOWN and final.attempts == 1
        assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    for record in reads:
        final = client.wait(record.key, 40)
        assert final.status is CallStatus.SUCCEEDED and final.attempts == 2
    assert ledger.executions(ledger_path) == {
        **{r.key: 1 for r in charges}, **{r.key: 2 for r in reads}}


def test_hard_time_limit_on_threads_ends_the_call_and_refuses_the_abandoned_thread(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a threads worker, a charge that runs 3 s past its 1 s limit (and then returns a
    # result), and reads and writes whose first or every attempt hangs past the limit
    worker: WorkerProcess = start_worker(concurrency=8, pool="threads", tools=TOOLS)
    charge = _call(client, "charge", "stubborn_charge", customer_id="cu_1", amount_cents=100,
                   mode="catch", run_for=3.0)
    read_once = _call(client, "read1", "timed_lookup", order_id="1001", slow_attempts=1)
    read_always = _call(client, "read2", "timed_lookup", order_id="1001", slow_attempts=99)
    write_always = _call(client, "write", "timed_address", order_id="1001", address="1 Main",
                         slow_attempts=99)

    # Then the charge ends outcome_unknown at its limit (its thread could not be killed)
    final = client.wait(charge.key, 20)
    assert final.status is CallStatus.OUTCOME_UNKNOWN and final.attempts == 1
    assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "hard time limit" in (final.error or "") and "abandoned" in (final.error or "")
    # (the limit counts from the task's start, as on prefork)
    assert final.finished_at is not None
    assert final.finished_at.timestamp() - final.created_at.timestamp() >= 1.0
    # ... a read whose first attempt hung runs again and succeeds; out of attempts, a read
    # fails and an idempotent write ends outcome_unknown
    again = client.wait(read_once.key, 20)
    assert again.status is CallStatus.SUCCEEDED and again.attempts == 2
    failed = client.wait(read_always.key, 20)
    assert failed.status is CallStatus.FAILED and failed.attempts == 2
    assert "time limit" in (failed.error or "")
    unknown = client.wait(write_always.key, 20)
    assert unknown.status is CallStatus.OUTCOME_UNKNOWN and unknown.attempts == 2

    # When the abandoned charge thread finally returns its result
    wait_until(lambda: f"action=abandoned_thread_returned key={charge.key}" in worker.log(),
               20, "the abandoned thread to return")
    # Then it ran on past its limit (a thread cannot be stopped: the documented limit), well
    # after the call had ended...
    lines = [e for e in ledger.read(ledger_path) if e["key"] == charge.key]
    start = next(e["at"] for e in lines if e["phase"] == "start")
    after = next(e["at"] for e in lines if e["phase"] == "after_limit")
    assert start < final.finished_at.timestamp() < after
    # ... but what it tried to record was refused: the record is exactly as ended at the limit
    assert client.get_tool_call(charge.key) == final
    events = client.store.events_for_call(charge.key)
    assert [(e.from_status, e.to_status) for e in events] == [
        (None, "queued"), ("queued", "running"), ("running", "outcome_unknown")]
    assert ledger.executions(ledger_path)[charge.key] >= 1
    assert sum(e.get("phase") == "start" for e in ledger.read(ledger_path)
               if e["key"] == charge.key) == 1


def test_an_abandoned_attempt_cannot_finish_the_attempt_another_thread_runs_now(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a read with a 2 s limit whose first attempt takes 3 s and its second 1.5 s, on one
    # threads worker: the second attempt runs in another thread of the same process while the
    # abandoned first one returns
    worker = start_worker(concurrency=4, pool="threads", tools=TOOLS)
    record = _call(client, "read", "overrunning_read", order_id="1001")

    # When both attempts have returned
    final = client.wait(record.key, 20)
    wait_until(lambda: f"action=abandoned_thread_returned key={record.key}" in worker.log(),
               20, "the abandoned first attempt to return")

    # Then the call holds the second attempt's result: the first attempt's late result was
    # refused, though it came back while the second attempt was running
    assert final.status is CallStatus.SUCCEEDED and final.attempts == 2
    assert final.result == {"order_id": "1001", "attempt": 2}
    lines = {(e["attempt"], e["phase"]): e for e in ledger.read(ledger_path)}
    first_end = lines[(1, "end")]["at"]
    assert lines[(2, "start")]["at"] < first_end < lines[(2, "end")]["at"]
    assert lines[(1, "start")]["pid"] == lines[(2, "start")]["pid"] == worker.pid
    assert client.get_tool_call(record.key) == final
