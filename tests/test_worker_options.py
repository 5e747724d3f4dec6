"""Celery's worker options on ``dex-tasks worker`` (issue 30, item 3): each passes through,
changes the configuration safely, or is refused with its reason; real workers throughout."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
import redis

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.broker.routing import live_workers
from dex_tasks.ops.worker_options import (
    REFUSED,
    WorkerOptionError,
    WorkerOptions,
    check_passthrough,
    hostname_taken,
    parse_autoscale,
)
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker, fast_settings
from tests.helpers import pid_alive, started_pid, wait_until
from tests.test_cli import run_dex
from workers import ledger

# -- the checks, without a worker -------------------------------------------------------------


@pytest.mark.parametrize("args", [["-Q", "dex.tool.x"], ["-Qdex.tool.x"], ["--queues=a"],
                                  ["-B"], ["--purge"], ["--detach"], ["--time-limit", "5"],
                                  ["--pool-start-method", "spawn"], ["-X", "a"]])
def test_options_that_would_change_the_guarantees_are_refused_with_the_reason(
    args: list[str],
) -> None:
    with pytest.raises(WorkerOptionError) as refused:
        check_passthrough(["--heartbeat-interval", "5", *args])
    name = args[0].split("=")[0][:2] if not args[0].startswith("--") else args[0].split("=")[0]
    assert str(refused.value) == f"dex-tasks worker does not take {name}: {REFUSED[name]}"


def test_other_options_pass_through_to_celery_untouched() -> None:
    options = WorkerOptions(pool="prefork", concurrency=3, hostname="w1@%h",
                            max_tasks_per_child=10, optimization="fair",
                            passthrough=("--heartbeat-interval", "5", "-S", "state.db"))
    args = options.celery_args("WARNING", quiet=False)
    assert args[:2] == ["worker", "-P"]
    assert args[args.index("-n") + 1] == "w1@%h"
    assert args[args.index("-c") + 1] == "3"
    assert args[args.index("--max-tasks-per-child") + 1] == "10"
    assert args[args.index("-O") + 1] == "fair"
    assert args[-4:] == ["--heartbeat-interval", "5", "-S", "state.db"]
    # Gossip and mingle stay off whatever was asked.
    assert "--without-gossip" in args and "--without-mingle" in args


def test_autoscale_is_checked_and_needs_prefork() -> None:
    assert parse_autoscale("10,2") == (10, 2)
    assert parse_autoscale("4") == (4, 0)
    for bad in ("", "x,1", "2,3", "0,0", "1,2,3"):
        with pytest.raises(WorkerOptionError, match="--autoscale takes MAX,MIN"):
            parse_autoscale(bad)
    with pytest.raises(WorkerOptionError, match="needs the prefork pool"):
        WorkerOptions(pool="threads", concurrency=8, autoscale="8,2")
    scaled = WorkerOptions(pool="prefork", concurrency=2, autoscale="5,1")
    assert scaled.slots == 5
    args = scaled.celery_args("INFO", quiet=True)
    assert args[0] == "--quiet" and "-c" not in args and "--autoscale" in args


def test_a_node_name_is_free_unless_a_live_process_elsewhere_holds_it() -> None:
    here = socket.gethostname()
    assert hostname_taken(None) is None
    # Our own announcement (a container restarted under its old name and pid) is ours.
    assert hostname_taken({"node": "w1@h", "host": here, "pid": os.getpid()}) is None
    # A process of this host that is gone left it.
    assert hostname_taken({"node": "w1@h", "host": here, "pid": 12345}, alive=False) is None
    taken = hostname_taken({"node": "w1@h", "host": here, "pid": 12345}, alive=True)
    assert taken is not None and "'w1@h' is in use by a live worker" in taken
    assert hostname_taken({"node": "w1@h", "host": "elsewhere", "pid": 1}) is not None


# -- real workers ------------------------------------------------------------------------------


def test_a_refused_option_ends_the_worker_with_one_line(env: dict[str, str]) -> None:
    result = run_dex(["worker", "--tools", "workers.example_tools", "-Q", "celery"], env)
    assert result.returncode == 2
    assert "dex-tasks worker does not take -Q: a worker consumes the queues of the tools it " \
           "serves; choose them with --serve" in result.stderr
    scaled = run_dex(["worker", "--tools", "workers.example_tools", "-P", "threads",
                      "--autoscale", "4,1"], env)
    assert scaled.returncode == 2
    assert "--autoscale needs the prefork pool" in scaled.stderr


def test_a_named_worker_replacing_children_runs_every_call_once_and_its_name_is_kept(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, env: dict[str, str],
) -> None:
    # Given a worker named by its operator, whose children each run one call, with Celery
    # options dex-tasks passes through untouched
    worker = start_worker(concurrency=1, args=[
        "-n", "orders-1@%h", "--max-tasks-per-child", "1", "-O", "fair",
        "--without-heartbeat", "--without-gossip", "--heartbeat-interval", "7"])
    node = f"orders-1@{socket.gethostname()}"
    wait_until(lambda: any(w["node"] == node for w in live_workers(client_redis(client))), 20,
               "the worker to announce its node name")

    # When it runs calls of both paths
    keys = [client.call_tool(session_id="s", turn_id="t", tool_call_id=f"c{i}",
                             tool="lookup_order" if i % 2 else "charge_card",
                             arguments={"order_id": "1001"} if i % 2 else
                             {"customer_id": "cu", "amount_cents": 100}).key
            for i in range(4)]

    # Then each ran once, each in a child of its own, owned under the operator's node name
    finals = [client.wait(key, timeout=30) for key in keys]
    assert [f.status for f in finals] == [CallStatus.SUCCEEDED] * 4
    runs = ledger.executions(ledger_path)
    assert all(runs[key] == 1 for key in keys)
    pids = {entry["pid"] for entry in ledger.read(ledger_path)}
    assert len(pids) == 4, "--max-tasks-per-child 1 replaces the child after each call"
    # (the single-attempt charges keep their owner on the record)
    owners = {client.store.get_call(key).worker for key in keys[::2]}  # type: ignore[union-attr]
    assert all(str(owner).startswith(node + ":") for owner in owners), owners

    # And a second worker under the same name is refused while the first lives
    second = run_dex(["worker", "--tools", "workers.example_tools", "-n", "orders-1@%h"], env)
    assert second.returncode == 2
    assert f"the node name '{node}' is in use by a live worker" in second.stderr
    assert worker.proc.poll() is None


def client_redis(client: DexClient) -> redis.Redis:
    return redis.Redis.from_url(client.settings.redis_url)


def test_an_autoscaled_worker_grows_runs_each_call_once_and_announces_its_maximum(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
) -> None:
    start_worker(concurrency=1, args=["--autoscale", "3,1"])
    records = [client.call_tool(session_id="s", turn_id="t", tool_call_id=f"c{i}",
                                tool="charge_card",
                                arguments={"customer_id": "cu", "amount_cents": i + 1,
                                           "sleep": 1.5})
               for i in range(6)]
    finals = [client.wait(r.key, timeout=60) for r in records]
    assert [f.status for f in finals] == [CallStatus.SUCCEEDED] * 6
    assert all(ledger.executions(ledger_path)[r.key] == 1 for r in records)
    (announced,) = live_workers(client_redis(client))
    assert announced["concurrency"] == 3
    # It did grow: more than one child ran calls.
    assert len({entry["pid"] for entry in ledger.read(ledger_path)}) > 1


class TestWithQuickHeartbeats:
    """Heartbeats every 0.5 s: a dead worker's announcement, and with it its claim on the
    messages it held, lapses within 3 s instead of 10 s (the lease is the fast settings' 3 s)."""

    @pytest.fixture
    def settings(self, redis_url: str, sqlite_url: str) -> DexSettings:
        return fast_settings(redis_url, sqlite_url, worker_heartbeat_seconds=0.5)

    def test_messages_a_prefetching_worker_held_when_it_died_run_once_elsewhere(
        self, client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime,
    ) -> None:
        # Given a one-slot worker that reserves four messages per slot, busy with a long charge
        doomed = start_worker(concurrency=1, args=["--prefetch-multiplier", "4"])
        records = [client.call_tool(session_id="s", turn_id="t", tool_call_id=f"c{i}",
                                    tool="charge_card",
                                    arguments={"customer_id": "cu", "amount_cents": i + 1,
                                               "sleep": 60 if i == 0 else 0})
                   for i in range(4)]
        running = started_pid(ledger_path, records[0].key)
        unacked = client_redis(client)
        wait_until(lambda: unacked.hlen("unacked") >= 3, 20,
                   "the worker to reserve messages ahead of its busy slot")

        # When the whole worker dies
        doomed.kill_all()
        wait_until(lambda: not pid_alive(running), 10, "the child to die")

        # Then another worker runs each reserved call once, once beat hands the messages back,
        # and the charge that was running ends outcome_unknown (never run again)
        start_worker(concurrency=2)

        def all_ended() -> bool:
            for job in ("reap_expired_leases", "restore_orphaned_messages"):
                run_job(rt, job)
            return all(client.get_tool_call(r.key).status.terminal for r in records)

        wait_until(all_ended, 90, "every call to end")
        statuses = [client.get_tool_call(r.key).status for r in records]
        assert statuses == [CallStatus.OUTCOME_UNKNOWN] + [CallStatus.SUCCEEDED] * 3
        runs = ledger.executions(ledger_path)
        assert all(runs[r.key] == 1 for r in records)
        assert doomed.proc.returncode == -signal.SIGKILL
