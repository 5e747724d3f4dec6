"""Hard and soft time limits, with real workers: the soft limit warns, the hard limit kills.

Every tool here has ``time_limit=1.0``: ``SoftTimeLimitExceeded`` is raised in the child at
0.8 s, and at 1 s the worker's main process kills the child. A killed attempt counts as a lost
one: single-attempt calls end ``outcome_unknown`` and never run again, retrying calls go again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient, ToolCallRecord
from dex_tasks.broker.celery_app import publish
from tests.conftest import StartWorker
from tests.helpers import pid_alive, wait_until
from workers import ledger


def _call(client: DexClient, call_id: str, tool: str, **arguments: Any) -> ToolCallRecord:
    return client.call_tool(session_id="s-limits", turn_id="t1", tool_call_id=call_id,
                            tool=tool, arguments=arguments)


def _lines(ledger_path: Path, key: str) -> list[dict[str, Any]]:
    return [entry for entry in ledger.read(ledger_path) if entry["key"] == key]


def test_soft_limit_single_attempt_ends_outcome_unknown_retrying_goes_again(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a worker, a charge that sleeps past its limit, and a read and an idempotent write
    # whose first attempt hangs past theirs
    start_worker(concurrency=2)
    charge = _call(client, "charge", "timed_charge", customer_id="cu_1", amount_cents=500,
                   sleep=30)
    read = _call(client, "read", "timed_lookup", order_id="1001", slow_attempts=1)
    write = _call(client, "write", "timed_address", order_id="1001", address="1 Main St",
                  slow_attempts=1)

    # Then the charge ends outcome_unknown after one execution, and is never run again
    final = client.wait(charge.key, timeout=20)
    assert final.status is CallStatus.OUTCOME_UNKNOWN
    assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "time limit" in (final.error or "")
    assert final.attempts == 1
    # ... and the timed-out read and write were retried and succeeded on attempt 2
    for record in (read, write):
        done = client.wait(record.key, timeout=20)
        assert done.status is CallStatus.SUCCEEDED, done.error
        assert done.attempts == 2
        assert done.result["attempt"] == 2
        assert ledger.executions(ledger_path)[record.key] == 2

    # When a duplicate message of the charge arrives later
    row = client.store.get_call(charge.key)
    assert row is not None
    publish(client.app, row)
    probe = _call(client, "probe", "lookup_order", order_id="1001")
    assert client.wait(probe.key, timeout=20).status is CallStatus.SUCCEEDED
    # Then it changed nothing
    assert ledger.executions(ledger_path)[charge.key] == 1
    assert client.get_tool_call(charge.key).status is CallStatus.OUTCOME_UNKNOWN


def test_every_attempt_timing_out_fails_a_read_and_leaves_a_write_unknown(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a read and an idempotent write whose every attempt hangs past the time limit
    start_worker(concurrency=2)
    read = _call(client, "read", "timed_lookup", order_id="1001", slow_attempts=99)
    write = _call(client, "write", "timed_address", order_id="1001", address="1 Main St",
                  slow_attempts=99)

    # Then the read fails (no effect to be unsure about) ...
    final_read = client.wait(read.key, timeout=25)
    assert final_read.status is CallStatus.FAILED
    assert final_read.attempts == 2
    assert "time limit" in (final_read.error or "")
    # ... and the write's outcome is unknown: an interrupted write may have taken effect
    final_write = client.wait(write.key, timeout=25)
    assert final_write.status is CallStatus.OUTCOME_UNKNOWN
    assert (final_write.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert final_write.attempts == 2
    counts = ledger.executions(ledger_path)
    assert counts[read.key] == 2
    assert counts[write.key] == 2


def test_hard_limit_kills_a_tool_that_ignores_the_soft_limit(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given charges that swallow SoftTimeLimitExceeded or block its signal (like C code), each
    # logging a tick every few ms and trying to log "after_limit" 3 s in, and a read whose first
    # attempt does the same
    worker = start_worker(concurrency=2)
    catch = _call(client, "catch", "stubborn_charge", customer_id="cu_1", amount_cents=100,
                  mode="catch")
    mask = _call(client, "mask", "stubborn_charge", customer_id="cu_2", amount_cents=200,
                 mode="mask")
    read = _call(client, "read", "stubborn_lookup", order_id="1001", mode="catch")

    for record, mode in ((catch, "catch"), (mask, "mask")):
        final = client.wait(record.key, timeout=20)
        # Then the hard limit ended each charge outcome_unknown ...
        assert final.status is CallStatus.OUTCOME_UNKNOWN
        assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
        assert "hard time limit" in (final.error or "")
        assert final.attempts == 1
        assert final.finished_at is not None
        lines = _lines(ledger_path, record.key)
        start = next(e for e in lines if e["phase"] == "start")
        # ... the tool did ignore the warning and run on past the soft limit ...
        assert any(e["phase"] == "tick" for e in lines)
        assert any(e["phase"] == "soft_limit" for e in lines) is (mode == "catch")
        # ... and was killed before its outcome was recorded: no line from after that moment
        finished = final.finished_at.timestamp()
        late = [e for e in lines if e["at"] >= finished]
        assert late == [], f"{mode}: the tool ran on after its outcome was recorded: {late}"
        wait_until(lambda p=start["pid"]: not pid_alive(p), 5, "the killed child to be gone")

    # And the read was retried after the kill, never with two attempts running at once
    final_read = client.wait(read.key, timeout=20)
    assert final_read.status is CallStatus.SUCCEEDED, final_read.error
    assert final_read.attempts == 2
    lines = _lines(ledger_path, read.key)
    second_start = next(e for e in lines if e["attempt"] == 2 and e["phase"] == "start")
    assert max(e["at"] for e in lines if e["attempt"] == 1) < second_start["at"]
    requeued = [e for e in client.store.events_for_call(read.key)
                if e.to_status == CallStatus.QUEUED.value and "hard time limit" in (e.detail or "")]
    assert len(requeued) == 1

    # When the moment a surviving tool would have logged "after_limit" has passed
    probe = _call(client, "probe", "lookup_order", order_id="1001", sleep=2.5)
    assert client.wait(probe.key, timeout=20).status is CallStatus.SUCCEEDED
    # Then no such line exists, no charge ran twice, and the worker itself lives on
    assert not [e for e in ledger.read(ledger_path) if e.get("phase") == "after_limit"]
    for record in (catch, mask):
        assert sum(e["phase"] == "start" for e in _lines(ledger_path, record.key)) == 1
    assert worker.proc.poll() is None
