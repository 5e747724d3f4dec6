"""Guarantees 1-3 under worker loss: SIGKILLed children and whole workers, real processes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient
from tests.conftest import StartWorker
from tests.helpers import pid_alive, started_pid, wait_until
from workers import ledger


def test_killed_child_mid_charge_ends_outcome_unknown_and_never_reruns(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a single-attempt charge that is running in a worker child
    worker = start_worker(concurrency=2)
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="charge_card",
                              arguments={"customer_id": "cu_1", "amount_cents": 500, "sleep": 30})
    pid = started_pid(ledger_path, record.key)
    assert pid in worker.children()

    # When the child is SIGKILLed mid-run
    os.kill(pid, signal.SIGKILL)

    # Then the main process records outcome_unknown, and the charge never runs again
    final = client.wait(record.key, timeout=20)
    assert final.status is CallStatus.OUTCOME_UNKNOWN
    assert final.error is not None and final.error.startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert final.attempts == 1
    # A later duplicate message and a sweep change nothing.
    from dex_tasks.broker.celery_app import publish

    publish(client.app, client.store.get_call(record.key))  # type: ignore[arg-type]
    probe = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                             tool="lookup_order", arguments={"order_id": "1001"})
    assert client.wait(probe.key, 20).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path)[record.key] == 1
    assert client.get_tool_call(record.key).status is CallStatus.OUTCOME_UNKNOWN
    assert worker.proc.poll() is None


def test_killed_child_on_retrying_path_is_redelivered_and_succeeds(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker(concurrency=2)
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="update_address",
                              arguments={"order_id": "1001", "address": "1 Main St",
                                         "sleep": 2})
    os.kill(started_pid(ledger_path, record.key, attempt=1), signal.SIGKILL)
    final = client.wait(record.key, timeout=30)
    assert final.status is CallStatus.SUCCEEDED
    assert final.attempts == 2
    assert ledger.executions(ledger_path)[record.key] == 2


def test_redelivery_after_worker_loss_is_bounded_by_max_attempts(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a read (3 attempts) whose child is killed on every attempt
    start_worker(concurrency=2)
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001", "sleep": 30})
    for attempt in (1, 2, 3):
        pid = started_pid(ledger_path, record.key, attempt)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda p=pid: not pid_alive(p), 10, "the child to die")
    # Then the read ends failed after exactly max_attempts executions, not run a fourth time
    final = client.wait(record.key, timeout=30)
    assert final.status is CallStatus.FAILED
    assert final.attempts == 3
    assert "3 attempts" in (final.error or "")
    assert ledger.executions(ledger_path)[record.key] == 3
