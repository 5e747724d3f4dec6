"""Guarantee 4, nothing is lost, and the sweeps that keep it: the lease reaper after a whole
worker vanishes, the republisher for lost messages, the end of a call stranded behind a dead
worker's Redis claim, and ``dex-tasks sweep`` / ``dex-tasks beat`` as real processes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    CallStatus,
    DexClient,
    DexSettings,
)
from dex_tasks.broker.celery_app import publish
from dex_tasks.broker.routing import queue_for
from dex_tasks.store import Store
from dex_tasks.worker import claims
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import JOBS, reap_expired_leases, republish_stranded, run_all, run_job
from tests.conftest import StartWorker
from tests.helpers import (
    ROOT,
    WorkerProcess,
    dex_command,
    start_process,
    started_pid,
    wait_until,
)
from workers import example_tools, ledger

# The agent process knows the example tools locally (the catalog path is tested elsewhere).
assert example_tools.lookup_order.name == "lookup_order"


def _finished_events(client: DexClient, key: str) -> list[tuple[str | None, str]]:
    return [(e.from_status, e.to_status) for e in client.store.events_for_call(key)]


@pytest.fixture
def short_client(settings: DexSettings) -> Iterator[DexClient]:
    """A second agent process whose retrying calls get only two attempts."""
    with DexClient(settings.model_copy(update={"default_max_attempts": 2})) as c:
        yield c


def test_whole_worker_loss_is_reaped_by_effect_class(
    client: DexClient, short_client: DexClient, start_worker: StartWorker,
    ledger_path: Path, rt: Runtime,
) -> None:
    # Given a worker running a charge, plus a read and an address update (two attempts each)
    # whose first attempt was lost with its child, so they now run their last attempt
    first = start_worker(concurrency=4)
    charge = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="charge",
                              tool="charge_card",
                              arguments={"customer_id": "cu_1", "amount_cents": 900, "sleep": 30})
    last_read = short_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="read2",
                                       tool="lookup_order",
                                       arguments={"order_id": "1001", "sleep": 30})
    last_write = short_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="write2",
                                        tool="update_address",
                                        arguments={"order_id": "1001", "address": "2 Elm St",
                                                   "sleep": 30})
    for pid in [started_pid(ledger_path, r.key, attempt=1) for r in (last_read, last_write)]:
        os.kill(pid, signal.SIGKILL)
    for record in (last_read, last_write):
        started_pid(ledger_path, record.key, attempt=2)
    started_pid(ledger_path, charge.key)
    # (While the worker lives, its main process renews the leases: a charge running for
    # longer than one lease is not reaped.)
    charge_at = next(e["at"] for e in ledger.read(ledger_path) if e["key"] == charge.key)
    lease = rt.settings.lease_seconds
    wait_until(lambda: time.time() > charge_at + lease + 0.2, 10, "one lease to pass")
    assert reap_expired_leases(rt) == 0
    renewed = client.store.get_call(charge.key)
    assert renewed is not None and renewed.status == "running"
    assert (renewed.lease_expires_at or 0) > charge_at + lease

    # And a read (three attempts) on its first attempt
    read = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="read",
                            tool="lookup_order", arguments={"order_id": "1002", "sleep": 1})
    started_pid(ledger_path, read.key)

    # When the whole worker disappears, and the reaper runs once the leases have run out
    first.kill_all()
    after_leases = time.time() + rt.settings.lease_seconds + 0.5
    # (The retrying calls' leases are in Redis, timed on Redis's own clock, which no ``now``
    # moves: the reaper runs once they have really lapsed.)
    wait_until(lambda: time.time() > after_leases, 20, "the leases to lapse")
    assert reap_expired_leases(rt, now=after_leases) == 4

    # Then the single-attempt charge is outcome_unknown, never to run again
    done = client.get_tool_call(charge.key)
    assert done.status is CallStatus.OUTCOME_UNKNOWN and done.attempts == 1
    assert done.error is not None and done.error.startswith(OUTCOME_UNKNOWN_TOOL_RESULT + ": ")
    assert "renewing its lease" in done.error
    # And the write whose attempts ran out is outcome_unknown, the read failed
    write = short_client.get_tool_call(last_write.key)
    assert write.status is CallStatus.OUTCOME_UNKNOWN and write.attempts == 2
    assert (write.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    exhausted = short_client.get_tool_call(last_read.key)
    assert exhausted.status is CallStatus.FAILED and exhausted.attempts == 2
    assert "2 attempts" in (exhausted.error or "")
    assert not (exhausted.error or "").startswith(TOOL_DID_NOT_RUN)
    # And the read with attempts left was requeued, and succeeds on another worker
    assert client.get_tool_call(read.key).status is CallStatus.QUEUED
    second = start_worker(concurrency=1)
    final = client.wait(read.key, 20)
    assert final.status is CallStatus.SUCCEEDED and final.attempts == 2
    assert final.result == {"order_id": "1002", "status": "processing", "total_cents": 1250}
    second_pid = started_pid(ledger_path, read.key, attempt=2)
    assert second_pid in second.children()

    # And reaping again, twice at once and with no lock, changes nothing
    before = [client.store.get_call(k) for k in (charge.key, read.key, last_read.key,
                                                  last_write.key)]
    counts: list[int] = []
    racers = [threading.Thread(target=lambda: counts.append(
        reap_expired_leases(rt, now=after_leases + 1))) for _ in range(2)]
    for thread in racers:
        thread.start()
    for thread in racers:
        thread.join(30)
    assert counts == [0, 0]
    assert [client.store.get_call(k) for k in (charge.key, read.key, last_read.key,
                                                last_write.key)] == before
    assert ledger.executions(ledger_path) == {charge.key: 1, last_read.key: 2,
                                              last_write.key: 2, read.key: 2}
    second.kill_all()


def _running_rows(store: Store, count: int, effect: str) -> list[str]:
    """Insert ``count`` calls that a vanished worker was running (lease long expired)."""
    keys = []
    now = time.time()
    for i in range(count):
        key = f"s9/t1/{effect}{i}"
        assert store.insert_call({
            "key": key, "session_id": "s9", "turn_id": "t1", "tool_call_id": f"{effect}{i}",
            "tool": "charge_card" if effect == "charge" else "lookup_order",
            "arguments": '{"amount_cents":1,"customer_id":"x"}' if effect == "charge"
            else '{"order_id":"1001"}',
            "effect": "non_idempotent_write" if effect == "charge" else "read",
            "requires_approval": False, "max_attempts": 1 if effect == "charge" else 3,
            "status": "running", "attempts": 1, "worker": "gone@host:1",
            "lease_expires_at": now - 100, "published_at": now - 100,
            "created_at": now - 100, "updated_at": now - 100,
        })
        keys.append(key)
    return keys


def test_concurrent_reapers_move_each_call_exactly_once(client: DexClient, rt: Runtime) -> None:
    # Given calls left running by a worker that vanished, on both paths
    charges = _running_rows(client.store, 15, "charge")
    reads = _running_rows(client.store, 15, "read")
    # When four reapers run at once, bypassing the sweep lock that normally saves the work
    start = threading.Barrier(4)
    counts: list[int] = []

    def reaper() -> None:
        start.wait()
        counts.append(reap_expired_leases(rt))

    threads = [threading.Thread(target=reaper) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # Then each call moved once: charges to outcome_unknown, reads back to queued
    assert sum(counts) == 30
    for key in charges:
        assert _finished_events(client, key)[1:] == [("running", "outcome_unknown")]
    for key in reads:
        assert _finished_events(client, key)[1:] == [("running", "queued")]
        assert client.get_tool_call(key).attempts == 1
    # And each requeued read was republished once, by the reaper that moved it
    messages = rt.redis.llen(queue_for("lookup_order"))
    assert messages == 15


def test_run_job_names_unknown_jobs_and_skips_while_locked(rt: Runtime) -> None:
    with pytest.raises(ValueError, match="'nope'"):
        run_job(rt, "nope")
    assert set(run_all(rt)) == set(JOBS)
    # A second runner while the first holds the lock does nothing.
    rt.redis.set("dex:sweep-lock:reap_expired_leases", "1", ex=5)
    _running_rows(rt.store, 1, "charge")
    assert run_job(rt, "reap_expired_leases") == 0
    rt.redis.delete("dex:sweep-lock:reap_expired_leases")
    assert run_job(rt, "reap_expired_leases") == 1


def test_lost_messages_are_republished_and_a_dead_claim_ends_did_not_run(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime,
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given calls whose messages were lost: never published (the agent died after the insert)...
    with monkeypatch.context() as patch:
        patch.setattr("dex_tasks.agent.client.publish", lambda *_, **__: None)
        unsent_read = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                       tool="lookup_order", arguments={"order_id": "1001"})
        unsent_charge = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                                         tool="charge_card",
                                         arguments={"customer_id": "cu_1", "amount_cents": 5})
    # ...or published and then lost inside Redis
    dropped = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c3",
                               tool="charge_card",
                               arguments={"customer_id": "cu_1", "amount_cents": 6})
    # And a charge whose message a worker took, claimed in Redis, and died before the store
    # claim: its message is gone (acked early) and only the claim remains
    claimed = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c4",
                               tool="charge_card",
                               arguments={"customer_id": "cu_1", "amount_cents": 7})
    assert rt.redis.delete(queue_for("charge_card")) == 1
    assert claims.try_claim(rt.redis, claimed.key, "dex-dead@gone:4242", ttl=3600)
    claimed_at = float(claims.read_claim(rt.redis, claimed.key)["at"])  # type: ignore[index]
    keys = [unsent_read.key, unsent_charge.key, dropped.key]
    worker = start_worker(concurrency=2)

    # When the republisher runs after the window, while the claim is still young
    window = rt.settings.republish_after_seconds
    assert republish_stranded(rt, now=claimed_at + window) == 3

    # Then the lost calls run, once each; the claimed call is left alone
    for key in keys:
        assert client.wait(key, 20).status is CallStatus.SUCCEEDED
    assert client.get_tool_call(claimed.key).status is CallStatus.QUEUED

    # When `dex-tasks sweep` runs once the claim is older than the window
    wait_until(lambda: time.time() > claimed_at + window + 0.05, 10, "the claim to age")
    out = subprocess.run([*dex_command(), "sweep"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["republish_stranded"] == 1

    # Then the claimed call ends "did not run", and a late duplicate of it runs nothing
    stranded = client.get_tool_call(claimed.key)
    assert stranded.status is CallStatus.FAILED and stranded.attempts == 0
    assert (stranded.error or "").startswith(TOOL_DID_NOT_RUN + ": ")
    row = client.store.get_call(claimed.key)
    assert row is not None
    publish(client.app, row)
    wait_until(lambda: f"key={claimed.key}" in worker.log()
               and "action=duplicate_delivery" in worker.log(), 10,
               "the late duplicate to be ignored")
    assert ledger.executions(ledger_path) == {key: 1 for key in keys}
    worker.kill_all()


def test_beat_reaps_a_lost_worker_with_only_beat_and_another_worker_running(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    env: dict[str, str], tmp_path: Path,
) -> None:
    # Given two beats (a misconfigured deploy) and two workers, one of them running a charge
    workers = [start_worker(concurrency=1, wait=False) for _ in range(2)]
    beats = [start_process(["beat"], env, tmp_path / f"beat-{i}.log") for i in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        charge = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                  tool="charge_card",
                                  arguments={"customer_id": "cu_1", "amount_cents": 10,
                                             "sleep": 30})
        pid = started_pid(ledger_path, charge.key)
        busy: WorkerProcess = next(w for w in workers if pid in w.children())
        survivor = next(w for w in workers if w is not busy)

        # When that worker vanishes
        busy.kill_all()

        # Then beat's sweep, run in the beat process itself, ends the charge outcome_unknown
        final = client.wait(charge.key, 20)
        assert final.status is CallStatus.OUTCOME_UNKNOWN
        assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
        # (a beat logs the reap after the commit that wakes us: wait for its line)
        def logs() -> list[str]:
            return [(tmp_path / f"beat-{i}.log").read_text() for i in range(2)]

        wait_until(lambda: any("job=reap_expired_leases count=1" in log for log in logs()), 20,
                   "a beat to log the reap")
        assert "reap_expired_leases" not in survivor.log()
        # And both beats were running sweeps, yet the call moved exactly once
        wait_until(lambda: all("dex.reap_expired_leases" in log for log in logs()), 30,
                   "both beats to run the reaper")
        assert _finished_events(client, charge.key) == [
            (None, "queued"), ("queued", "running"), ("running", "outcome_unknown"),
        ]
        assert ledger.executions(ledger_path) == {charge.key: 1}
    finally:
        for beat in beats:
            beat.kill()
            beat.wait(10)
    survivor.kill_all()


def test_sweeps_log_at_debug_unless_they_did_something(
    client: DexClient, rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    # Given nothing to do: each sweep logs its run at DEBUG
    caplog.set_level(logging.DEBUG, logger="dex_tasks.worker.sweeps")
    run_all(rt)
    done = [r for r in caplog.records if r.getMessage() == "sweep done"]
    assert {r.job for r in done} == set(JOBS)  # type: ignore[attr-defined]
    assert {r.levelno for r in done} == {logging.DEBUG}

    # Given an approval past its deadline: the sweep that rejects it logs at INFO
    caplog.clear()
    client.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="refund_payment",
                     arguments={"charge_id": "ch_1", "amount_cents": 1}, approval_deadline=60)
    assert run_job(rt, "expire_approvals", now=time.time() + 120) == 1
    (record,) = [r for r in caplog.records if r.getMessage() == "sweep done"]
    assert record.levelno == logging.INFO and record.count == 1  # type: ignore[attr-defined]
