"""Bounded recovery (issue 19): what the partition scenarios rely on, one piece at a time.

The scenarios themselves (real namespaces, silent drops) are ``tests/test_partitions.py`` and
``make chaos``; here each bound is checked on its own, on both engines where it has a store
side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
from sqlalchemy import text
from sqlalchemy.engine import Connection

from dex_tasks import CallStatus, DexClient, StoreUnavailableError
from dex_tasks.broker import routing
from dex_tasks.store import Store, bounded_statements
from dex_tasks.worker import claims
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import republish_stranded
from tests.conftest import fast_settings
from workers import example_tools

assert example_tools.lookup_order.name == "lookup_order"  # registered in this process


@pytest.fixture
def lost_client(redis_url: str, sqlite_url: str) -> Iterator[DexClient]:
    """A client whose republisher window is long (300 s) and whose lost-message check is 1 s."""
    settings = fast_settings(redis_url, sqlite_url, republish_after_seconds=300.0,
                             republish_lost_after_seconds=1.0)
    with DexClient(settings) as c:
        yield c


def test_a_message_lost_in_transit_is_republished_long_before_the_window(
        lost_client: DexClient) -> None:
    rt = Runtime(settings=lost_client.settings, store=lost_client.store,
                 redis=redis.Redis.from_url(lost_client.settings.redis_url), app=lost_client.app)
    # A live worker serves the tool (its announcement), so the republisher acts on it
    rt.redis.set(routing.WORKER_KEY + "dex-1@gone",
                 routing.worker_record("dex-1@gone", ["lookup_order"], pool="prefork",
                                       concurrency=1), ex=60)
    record = lost_client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                   tool="lookup_order", arguments={"order_id": "1001"})
    queue = routing.queue_for("lookup_order")
    assert rt.redis.llen(queue) == 1
    # (call_tool's publish mark is written by a thread of the store: wait for it, as the
    # republisher reads a call with no mark yet as one never sent)
    lost_client.store.flush_publish_marks()
    later = time.time() + 5
    # While its message waits in its queue, the call is not sent again inside the window
    assert republish_stranded(rt, now=later) == 0
    assert rt.redis.llen(queue) == 1
    # When the message vanishes (a BRPOP whose answer a partition swallowed), it is
    assert rt.redis.delete(queue) == 1
    assert republish_stranded(rt, now=later) == 1
    assert rt.redis.llen(queue) == 1
    row = lost_client.store.get_call(record.key)
    assert row is not None and row.republishes == 1
    rt.redis.close()


def test_store_sessions_carry_the_network_bounds(database_url: str) -> None:
    store = Store(database_url)
    try:
        if store.is_postgres:
            with store.read() as conn:
                idle, user_timeout, statement = conn.execute(text(
                    "SELECT current_setting('idle_in_transaction_session_timeout'), "
                    "current_setting('tcp_user_timeout'), "
                    "current_setting('statement_timeout')")).one()
            # Set by the client on every session: no server configuration needed
            assert (idle, user_timeout, statement) == ("10s", "10000", "0")
            with bounded_statements(20, 2), store.write() as conn:
                bounds = conn.execute(text("SELECT current_setting('statement_timeout'), "
                                           "current_setting('lock_timeout')")).one()
            assert tuple(bounds) == ("20s", "2s")
            with store.write() as conn:  # the bound ended with its transaction
                assert conn.execute(text("SELECT current_setting('lock_timeout')")
                                    ).scalar_one() == "0"
        else:
            with bounded_statements(20, 2), store.write() as conn:
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 2000
            with store.write() as conn:
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 30000
    finally:
        store.close()


@contextmanager
def _running_call_behind_a_row_lock(redis_url: str, postgres_url: str,
                                    ) -> Iterator[tuple[Store, str, Connection]]:
    """A call claimed by ``node:1`` whose row another session holds locked (a vanished host's
    session, which only the server's idle-in-transaction timeout would end): the store (one
    second of retries), the call's key and the session holding the lock."""
    with DexClient(fast_settings(redis_url, postgres_url)) as client:
        record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        store = Store(postgres_url, retry_seconds=1.0)
        holder = store.engine.connect()
        try:
            assert store.claim(record.key, "node:1", 30, lambda row: None) is not None
            holder.execute(text("SELECT 1 FROM dex_tool_calls WHERE key = :k FOR UPDATE"),
                           {"k": record.key})
            yield store, record.key, holder
        finally:
            holder.close()
            store.close()


def test_a_renewal_behind_a_held_row_lock_fails_fast_instead_of_queueing(
        redis_url: str, postgres_url: str) -> None:
    # Given a running call whose row another session has locked
    with _running_call_behind_a_row_lock(redis_url, postgres_url) as (store, key, holder):
        # When the worker renews under the sweeps' bounds, it gives up within its retries
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="lock timeout"):
            with bounded_statements(20, 0.2):
                store.renew_leases("node:", [key], 30)
        assert time.monotonic() - started < 3
        holder.rollback()
        # And once the lock is gone it renews at once
        with bounded_statements(20, 0.2):
            assert store.renew_leases("node:", [key], 30) == 1


class _LosesFirstReply(redis.Redis):
    """A client whose first SET reaches Redis but whose reply is lost (a cut mid-command)."""

    lost = False

    def set(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        result = super().set(*args, **kwargs)  # type: ignore[arg-type]
        if not self.lost:
            self.lost = True
            raise redis.ConnectionError("Error 32 while writing to socket. Broken pipe.")
        return result


def test_a_claim_whose_reply_was_lost_is_recognised_as_our_own(redis_url: str) -> None:
    lossy = _LosesFirstReply.from_url(redis_url)
    other = redis.Redis.from_url(redis_url)
    try:
        # The retry finds its own unique value: the claim is ours, not a duplicate's
        assert claims.try_claim(lossy, "key-1", "node:1", 60, retry_seconds=5)
        # Another delivery of the same call is turned away
        assert not claims.try_claim(other, "key-1", "node:2", 60, retry_seconds=5)
    finally:
        lossy.close()
        other.close()


def test_a_claim_gives_up_after_its_retries_when_redis_stays_away() -> None:
    client = redis.Redis(port=1, socket_connect_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        claims.try_claim(client, "key-1", "node:1", 60, retry_seconds=1.0)
    assert time.monotonic() - started < 8


def test_a_one_statement_move_behind_a_held_row_lock_fails_fast_under_the_bounds(
        redis_url: str, postgres_url: str) -> None:
    # Given a running call whose row another session has locked
    with _running_call_behind_a_row_lock(redis_url, postgres_url) as (store, key, holder):
        # When a sweep ends it under its bounds (on PostgreSQL a move is one statement in
        # autocommit, where a SET LOCAL of the bounds ended before the statement ran)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="lock timeout"):
            with bounded_statements(20, 0.2):
                store.transition(key, CallStatus.OUTCOME_UNKNOWN, allowed={CallStatus.RUNNING},
                                 values={"error": "lost"})
        # Then it gave up within its retries instead of queueing behind the lock
        assert time.monotonic() - started < 3
        holder.rollback()
        # And once the lock is gone it moves at once
        with bounded_statements(20, 0.2):
            assert store.transition(key, CallStatus.OUTCOME_UNKNOWN,
                                    allowed={CallStatus.RUNNING}, values={"error": "lost"})
        # And the bound ended with it: every pooled session is handed out at once, the one
        # the move used among them, and none is bounded
        pooled = [store.autocommit_engine.connect() for _ in range(6)]
        try:
            assert [conn.execute(text("SELECT current_setting('lock_timeout')")).scalar_one()
                    for conn in pooled] == ["0"] * 6
        finally:
            for conn in pooled:
                conn.close()
