"""A retrying call writes the store twice (DESIGN version 4, "What a call costs"): when it is
requested and when it ends. While it runs, its ``running`` is a lease in Redis, and every
reader that shows the call (``get_tool_call``, the snapshot, ``/metrics``) shows it running
from that lease; the ending records the start and the end together."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.broker.metrics import render_metrics
from dex_tasks.broker.runs import RUNS_KEY, Runs
from tests.conftest import StartWorker, fast_settings
from tests.helpers import wait_until
from workers import ledger

TOOLS = "workers.example_tools,chaos.tools"


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    # Both stores: the ending's one statement differs (PostgreSQL writes both events in it).
    return fast_settings(redis_url, database_url)


def _running_read(client: DexClient, start_worker: StartWorker, ledger_path: Path,
                  session_id: str) -> str:
    """A read on a worker of its own whose first attempt runs for three seconds, once its
    tool has started: its key."""
    start_worker(concurrency=1, tools=TOOLS)
    key = client.call_tool(session_id=session_id, turn_id="t", tool_call_id="c",
                           tool="stall_first_attempt",
                           arguments={"order_id": session_id, "sleep": 3}).key
    wait_until(lambda: len(ledger.read(ledger_path)) == 1, 30, "the tool to start")
    return key


def test_a_running_read_is_queued_in_the_store_and_shown_running_from_its_lease(
    client: DexClient, start_worker: StartWorker, redis_url: str, ledger_path: Path
) -> None:
    # Given a worker running a read whose first attempt takes a few seconds
    key = _running_read(client, start_worker, ledger_path, "s")

    # Then while it runs the store still says queued, with only the request's event...
    stored = client.store.get_call(key)
    assert stored is not None and stored.status == CallStatus.QUEUED.value
    assert [e.event for e in client.store.events_for_call(key)] == ["tool_call_requested"]
    # ...and every reader shows it running, with its attempt and worker, from Redis's lease
    shown = client.get_tool_call(key)
    assert shown.status is CallStatus.RUNNING and shown.attempts == 1
    snapshot = client.get_agent_snapshot("s")
    assert [(c.key, c.status, c.attempts) for c in snapshot.tool_calls] == [
        (key, CallStatus.RUNNING, 1)]
    r = redis.Redis.from_url(redis_url)
    body, _ = render_metrics(client.store, r)
    text = body.decode()
    assert ('dex_tool_calls_open{effect="read",status="running",tool="stall_first_attempt"} '
            '1.0') in text
    assert 'status="queued",tool="stall_first_attempt"} 1.0' not in text
    run = Runs(r).get(key)
    assert run is not None and run.attempt == 1 and run.worker.count(":") >= 1

    # When it ends
    ended = client.wait(key, 30)

    # Then its one ending wrote the start and the end together, in order, and the lease is gone
    assert ended.status is CallStatus.SUCCEEDED and ended.attempts == 1
    events = client.store.events_for_call(key)
    assert events[0].event == "tool_call_requested"
    assert [(e.event, e.from_status, e.to_status) for e in events[1:]] == [
        ("tool_call_started", "queued", "running"),
        ("tool_call_finished", "running", "succeeded"),
    ]
    assert events[1].created_at <= events[2].created_at
    # (dropped just after the ending's commit)
    wait_until(lambda: Runs(r).get(key) is None and r.zscore(RUNS_KEY, key) is None
               and Runs(r).attempts(key) == 0, 10, "the lease and the count to be dropped")


def test_wait_reads_the_store_and_only_its_timeout_shows_the_lease(
    client: DexClient, start_worker: StartWorker, redis_url: str, ledger_path: Path
) -> None:
    # Given a read whose first attempt runs for a few seconds (queued in the store, running
    # in Redis)
    key = _running_read(client, start_worker, ledger_path, "w")
    r = redis.Redis.from_url(redis_url)

    def run_reads() -> int:  # Runs.get_many's HMGET of a run hash, the overlay's one read
        return int(r.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))

    # When a waiter that reads every 0.1 s gives up on it before it ends
    waiter = DexClient(client.settings.model_copy(update={"wait_poll_seconds": 0.1}))
    before = run_reads()
    try:
        with pytest.raises(TimeoutError, match="is still running after"):
            waiter.wait(key, timeout=1.0)
    finally:
        waiter.close()

    # Then it read Redis's runs once, for its timeout's answer (which shows the lease), and
    # the store for everything else
    assert run_reads() == before + 1
    # And a waiter that stays gets the ending
    assert client.wait(key, 30).status is CallStatus.SUCCEEDED
