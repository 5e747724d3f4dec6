"""Guarantee 1, at most once on the single-attempt path, with real Redis and real workers.

Duplicate messages, a second ``call_tool``, SIGKILLed children, whole workers that vanish and
sweeps running concurrently: the ledger (one fsynced line per execution) never shows a key
executed twice, and every call ends terminal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    CallStatus,
    DexClient,
    ToolCallRecord,
)
from dex_tasks.broker.celery_app import publish
from dex_tasks.broker.routing import queue_for
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import reap_expired_leases, republish_stranded, run_all
from tests.conftest import StartWorker
from tests.helpers import WorkerProcess, dex_command, pid_alive, wait_until
from workers import example_tools, ledger

# The agent process knows the example tools locally (the catalog path is tested elsewhere).
assert example_tools.charge_card.name == "charge_card"


def _ignored(worker: WorkerProcess, key: str) -> int:
    """How many deliveries of ``key`` the worker logged as duplicates it ignored."""
    return sum(1 for line in worker.log().splitlines()
               if "action=duplicate_delivery" in line and f"key={key}" in line)


def _charge(client: DexClient, call_id: str, sleep: float = 0.0,
            session: str = "s1") -> ToolCallRecord:
    return client.call_tool(session_id=session, turn_id="t1", tool_call_id=call_id,
                            tool="charge_card",
                            arguments={"customer_id": "cu_1", "amount_cents": 250,
                                       "sleep": sleep})


def test_a_message_delivered_twice_and_a_repeated_call_run_once(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime
) -> None:
    # Given a charge and an address update, each with a second message for the same row,
    # both waiting in Redis before any worker runs
    charge = _charge(client, "c1", sleep=0.5)
    update = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                              tool="update_address",
                              arguments={"order_id": "1001", "address": "1 Main St"})
    for record in (charge, update):
        row = client.store.get_call(record.key)
        assert row is not None
        publish(client.app, row)
    assert rt.redis.llen(queue_for("charge_card")) == 2
    assert rt.redis.llen(queue_for("update_address")) == 2

    # When a worker with two children takes both copies at once
    worker = start_worker(concurrency=2)

    # Then each call ran exactly once, and the other delivery was logged and ignored
    for record in (charge, update):
        assert client.wait(record.key, 20).status is CallStatus.SUCCEEDED
        wait_until(lambda k=record.key: _ignored(worker, k) == 1, 10,
                   f"the duplicate of {record.key} to be ignored")
    assert ledger.executions(ledger_path) == {charge.key: 1, update.key: 1}

    # And calling again with the same key returns the same record and sends nothing
    again = _charge(client, "c1", sleep=0.5)
    assert again == client.get_tool_call(charge.key)
    assert again.status is CallStatus.SUCCEEDED and again.attempts == 1
    assert rt.redis.llen(queue_for("charge_card")) == 0
    # A late duplicate (a republish, or a visibility-timeout redelivery) changes nothing.
    finished = client.store.get_call(charge.key)
    assert finished is not None
    publish(client.app, finished)
    wait_until(lambda: _ignored(worker, charge.key) == 2, 10, "the late duplicate to be ignored")
    assert client.store.get_call(charge.key) == finished
    assert ledger.executions(ledger_path) == {charge.key: 1, update.key: 1}
    worker.kill_all()


def _running_on(ledger_path: Path, pids: set[int], client: DexClient) -> dict[str, int]:
    """{key: child pid} of the charges running in those processes, most recent start first."""
    running: dict[str, int] = {}
    for entry in sorted(ledger.read(ledger_path), key=lambda e: -e["at"]):
        if entry["pid"] in pids:
            call = client.store.get_call(entry["key"])
            if call is not None and call.status == CallStatus.RUNNING.value:
                running[entry["key"]] = int(entry["pid"])
    return running


def test_at_most_once_through_duplicates_kills_and_concurrent_sweeps(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime,
    env: dict[str, str],
) -> None:
    # Given two workers and 30 charges, a third of them published twice
    first = start_worker(concurrency=2, wait=False)
    second = start_worker(concurrency=2, wait=False)
    first.wait_ready()
    second.wait_ready()
    records = [_charge(client, f"c{i}", sleep=0.4 + (i % 4) * 0.2) for i in range(30)]
    for record in records[::3]:
        row = client.store.get_call(record.key)
        assert row is not None
        publish(client.app, row)

    # And sweeps running all the time: the scheduled form (under its lock) and the bare jobs
    # (no lock at all) at once, as two beats would
    stop = threading.Event()
    errors: list[BaseException] = []

    def sweeping(bare: bool) -> None:
        while not stop.wait(0.2):
            try:
                if bare:
                    reap_expired_leases(rt)
                    republish_stranded(rt)
                else:
                    run_all(rt)
            except BaseException as err:  # noqa: BLE001 - reported by the test below
                errors.append(err)

    sweepers = [threading.Thread(target=sweeping, args=(bare,)) for bare in (False, True)]
    for thread in sweepers:
        thread.start()
    try:
        # When a busy child of the first worker is SIGKILLed
        # (the one that started last: it has the most left to do)
        key, pid = next(iter(wait_until(
            lambda: _running_on(ledger_path, set(first.children()), client), 20,
            "a charge running on the first worker").items()))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        # And the whole second worker disappears mid-run, and a replacement starts
        doomed = set(second.children())
        wait_until(lambda: _running_on(ledger_path, doomed, client), 20,
                   "a charge running on the second worker")
        second.kill_all()
        # (what was still running there when it died; nothing can finish those now but the reaper)
        lost = _running_on(ledger_path, doomed, client)
        third = start_worker(concurrency=2)
        # And an operator runs `dex-tasks sweep` meanwhile
        sweep = subprocess.run([*dex_command(), "sweep"], env=env, capture_output=True, timeout=60,
                               cwd=Path(__file__).resolve().parent.parent)
        assert sweep.returncode == 0, sweep.stderr

        # Then every call ends terminal
        for record in records:
            client.wait(record.key, timeout=40)
    finally:
        stop.set()
        for thread in sweepers:
            thread.join(10)
    assert errors == []

    # And no key ever executed twice; each outcome matches the ledger
    runs = ledger.executions(ledger_path)
    assert max(runs.values()) == 1
    final = {r.key: client.get_tool_call(r.key) for r in records}
    for k, record in final.items():
        starts = [e for e in client.store.events_for_call(k) if e.to_status == "running"]
        assert len(starts) <= 1 and record.attempts <= 1
        if record.status is CallStatus.SUCCEEDED:
            assert runs[k] == 1 and record.attempts == 1
        elif record.status is CallStatus.OUTCOME_UNKNOWN:
            assert record.error is not None
            assert record.error.startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
            assert runs[k] <= 1
        else:
            # The only failure a charge can have here: a delivery that never reached the tool.
            assert record.status is CallStatus.FAILED
            assert record.error is not None and record.error.startswith(TOOL_DID_NOT_RUN)
            assert runs[k] == 0
    # The killed child's charge and the lost worker's charge are honest about it.
    # (Unless the charge ended just before the SIGKILL landed: a dead child writes nothing.)
    if final[key].status is CallStatus.SUCCEEDED:
        assert final[key].finished_at is not None
        assert final[key].finished_at.timestamp() < killed_at
    else:
        assert final[key].status is CallStatus.OUTCOME_UNKNOWN
    assert lost
    for lost_key in lost:
        assert final[lost_key].status is CallStatus.OUTCOME_UNKNOWN
        assert "renewing its lease" in (final[lost_key].error or "")
    assert not pid_alive(pid)
    succeeded = sum(r.status is CallStatus.SUCCEEDED for r in final.values())
    assert succeeded >= len(records) - 6, {k: r.status.value for k, r in final.items()}

    # And one more round of sweeps, twice at once, changes nothing
    before = {r.key: client.store.get_call(r.key) for r in records}
    rounds: list[dict[str, int]] = []
    pair = [threading.Thread(target=lambda: rounds.append(run_all(rt))) for _ in range(2)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(30)
    assert {r.key: client.store.get_call(r.key) for r in records} == before
    assert ledger.executions(ledger_path) == runs
    for worker in (first, third):
        worker.kill_all()
