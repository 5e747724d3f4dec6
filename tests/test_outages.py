"""Outages: Redis restarting under busy workers, Redis down at call time, the store unreachable.

Each Redis test runs its own ``redis-server`` (AOF on, as in production) so that killing it
hurts no other test. "Restart" means SIGKILL, then start again on the same port and directory,
so the server reloads its append-only file the way a crashed production Redis does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    CallNotFoundError,
    CallStatus,
    DexClient,
    DexSettings,
    StoreUnavailableError,
)
from tests.conftest import StartWorker, fast_settings
from tests.helpers import RedisServer, free_port
from workers import example_tools, ledger

# Registered locally too, so tests without a worker (no published catalog) can call them.
assert example_tools.lookup_order

AOF = ["--appendonly", "yes", "--appendfsync", "everysec"]


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server for this test alone, which the test may kill and restart."""
    server = RedisServer(free_port(), extra=AOF).start()
    yield server
    server.cleanup()


@pytest.fixture
def settings(private_redis: RedisServer, sqlite_url: str) -> DexSettings:
    # Overrides conftest's fixture, so `client`, `env` and `start_worker` use the private Redis.
    return fast_settings(f"{private_redis.url}/0", sqlite_url)


def _lookup(client: DexClient, call_id: str, sleep: float = 0.0) -> str:
    record = client.call_tool(session_id="s", turn_id="t", tool_call_id=call_id,
                              tool="lookup_order", arguments={"order_id": "1001", "sleep": sleep})
    return record.key


def test_busy_workers_survive_redis_restarts_and_consume_again(
    client: DexClient, start_worker: StartWorker, private_redis: RedisServer, ledger_path: Path
) -> None:
    # Given a worker running a late-acked call, so it holds an unacked message. Celery/kombu
    # 5.7 shut such a worker down when the connection dropped
    # (dex_tasks.worker.main_process.DexConsumer
    # has the details); the same worker process must keep serving.
    worker = start_worker(concurrency=2)
    assert client.wait(_lookup(client, "warm-up"), 20).status is CallStatus.SUCCEEDED

    # Two crashes (a reconnect that works once and stalls the next time is a known bug), then a
    # reset of every client connection with Redis up (celery#10205).
    for round_, outage in enumerate(("crash", "crash", "reset")):
        in_flight = _lookup(client, f"in-flight-{round_}", sleep=1.5)
        _wait_running(client, in_flight)

        # When Redis crashes and comes back on the same port and directory (or drops clients)
        if outage == "crash":
            private_redis.stop()
            private_redis.start()
        else:
            admin = redis.Redis(port=private_redis.port)
            assert admin.client_kill_filter(_type="normal", skipme=True) > 0
            admin.close()
        restarted = time.monotonic()

        # Then calls made after the restart complete, and the call that ran across it succeeds
        # once; reconnecting takes Celery one retry interval (2 s) at most here.
        after = [_lookup(client, f"after-{round_}-{i}") for i in range(3)]
        for key in after:
            assert client.wait(key, 15).status is CallStatus.SUCCEEDED
        resumed = time.monotonic() - restarted
        assert resumed < 10, f"consuming resumed only {resumed:.1f}s after the {outage}"
        final = client.wait(in_flight, 15)
        assert final.status is CallStatus.SUCCEEDED and final.attempts == 1

    assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
    assert "Unrecoverable error" not in worker.log()
    runs = ledger.executions(ledger_path)
    assert len(runs) == 13 and set(runs.values()) == {1}


def _wait_running(client: DexClient, key: str) -> None:
    deadline = time.monotonic() + 15
    while client.get_tool_call(key).status is not CallStatus.RUNNING:
        assert time.monotonic() < deadline, f"{key} never started"
        time.sleep(0.02)


def test_call_tool_during_a_redis_outage_fails_fast_as_did_not_run(
    client: DexClient, private_redis: RedisServer
) -> None:
    # Given a client that has published before (its broker connections are pooled and warm)
    assert client.get_tool_call(_lookup(client, "before")).status is CallStatus.QUEUED

    # When Redis is down and the agent calls a read and a single-attempt write
    private_redis.stop()
    for call_id, tool, arguments in (
        ("read", "lookup_order", {"order_id": "1001"}),
        ("charge", "charge_card", {"customer_id": "cu_1", "amount_cents": 100}),
    ):
        started = time.monotonic()
        record = client.call_tool(session_id="s", turn_id="t", tool_call_id=call_id,
                                  tool=tool, arguments=arguments)
        elapsed = time.monotonic() - started

        # Then call_tool returns within a few seconds (publish_timeout_seconds is 1 here) with
        # a failed record that tells the model it is safe to call again
        assert elapsed < 5, f"call_tool took {elapsed:.1f}s with Redis down"
        assert record.status is CallStatus.FAILED
        assert record.error is not None and record.error.startswith(TOOL_DID_NOT_RUN)
        assert record.attempts == 0
        assert client.get_tool_call(record.key) == record


def test_unreachable_postgres_gives_store_unavailable_quickly(private_redis: RedisServer) -> None:
    # Given a PostgreSQL URL (with a password) pointing at a port nobody listens on
    url = f"postgresql+psycopg://dex:s3cret-pw@127.0.0.1:{free_port()}/dex"
    settings = fast_settings(f"{private_redis.url}/0", url)

    # When an agent process starts a client or calls a tool
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as at_start:
        DexClient(settings)
    client = DexClient(settings, create_tables=False)
    with pytest.raises(StoreUnavailableError) as at_call:
        client.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="lookup_order",
                         arguments={"order_id": "1001"})
    client.close()

    # Then both fail fast with a DexError that names the store but not its password
    assert time.monotonic() - started < 10
    for err in (at_start.value, at_call.value):
        assert "127.0.0.1" in str(err) and "s3cret-pw" not in str(err)


def test_unreachable_sqlite_store_leaves_no_half_written_call(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    # Given a SQLite store whose directory does not exist (a volume that is not mounted)
    missing = tmp_path / "not-mounted"
    settings = fast_settings(f"{private_redis.url}/0", f"sqlite:///{missing / 'dex.db'}")
    client = DexClient(settings, create_tables=False)

    # When the agent calls a tool
    with pytest.raises(StoreUnavailableError, match="not-mounted"):
        client.call_tool(session_id="s", turn_id="t", tool_call_id="c", tool="lookup_order",
                         arguments={"order_id": "1001"})
    client.close()

    # Then, once the store is back, no trace of the call exists and the same key starts afresh
    missing.mkdir()
    with DexClient(settings) as back:
        with pytest.raises(CallNotFoundError):
            back.get_tool_call("s/t/c")
        assert back.events("s") == []
        record = back.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                tool="lookup_order", arguments={"order_id": "1001"})
        assert record.status is CallStatus.QUEUED
        assert [e.event for e in back.events("s")] == ["tool_call_requested"]
