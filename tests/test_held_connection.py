"""The connection a store keeps between transactions (``store/held.py``).

Most transactions of a process come one after another on one thread (a worker child's read
and ending, a producer's insert and ``wait``), so each takes the connection the last one left
instead of checking one out of SQLAlchemy's pool. These tests hold it to what the pool gave:
no transaction left open between uses (a read's snapshot would hide later writes, and a
held write lock would stop every other process), a failed connection never reused, nothing
shared across a fork, none held past ``close``; on PostgreSQL, a connection the server
closed while it sat idle replaced before use (as the pool's ping does), and an old one
recycled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text

from dex_tasks.store import CALLS, Store
from dex_tasks.store.held import HeldConnection
from tests.test_store import call_row


@pytest.fixture
def store(sqlite_store: Store) -> Store:
    return sqlite_store


def _row(key: str) -> dict[str, Any]:
    return call_row(key, effect="read", max_attempts=3)


def _dbapi(conn: Any) -> Any:
    return conn.connection.dbapi_connection


def test_consecutive_transactions_share_one_connection(store: Store) -> None:
    # When one thread writes, reads, and writes again
    with store.write() as tx:
        first = _dbapi(tx)
        tx.execute(text("SELECT 1"))
    with store.write() as tx:
        second = _dbapi(tx)
    with store.read() as conn:
        read_first = _dbapi(conn)
    with store.read() as conn:
        read_second = _dbapi(conn)
    # Then each engine's transactions ran on the same connection, none checked out between
    assert first is second
    assert read_first is read_second
    assert store.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    assert store.read_engine.pool.checkedout() == 1  # type: ignore[attr-defined]


def test_a_held_read_connection_keeps_no_snapshot(store: Store) -> None:
    # Given a read that began a transaction (SQLAlchemy begins one on first use) and ended
    with store.read() as conn:
        assert conn.execute(select(CALLS.c.key)).all() == []
        held = _dbapi(conn)
    assert not held.in_transaction
    # When another process's connection writes a call
    other = Store(store.url)
    try:
        assert other.insert_call(_row("s/t/c1"))
        # Then the next read, on the held connection, sees it (a snapshot kept from the first
        # read would not), and the write could commit at all (no lock was left held)
        with store.read() as conn:
            assert _dbapi(conn) is held
            assert conn.execute(select(CALLS.c.key)).scalars().all() == ["s/t/c1"]
    finally:
        other.close()


def test_a_calls_read_runs_on_the_writers_connection_and_never_waits_for_a_writer(
    store: Store,
) -> None:
    # Given a call written through the store's write connection
    assert store.insert_call(_row("s/t/c1"))
    with store.write() as tx:
        writer = _dbapi(tx)
    # When the call is read, then it is read on that same connection (whose page cache the
    # write kept current), which the read leaves with no transaction open
    statements: list[str] = []
    writer.set_trace_callback(statements.append)
    try:
        call = store.get_call("s/t/c1")
        assert call is not None and call.key == "s/t/c1"
        assert store.get_call_columns("s/t/c1") is not None
    finally:
        writer.set_trace_callback(None)
    assert [s for s in statements if s.lstrip().upper().startswith("SELECT")], statements
    assert not [s for s in statements if "BEGIN" in s.upper()]
    assert not writer.in_transaction
    # And while another thread holds the write lock (an ending being committed), a read of a
    # call neither waits for it nor sees what it has not committed
    inside, release = threading.Event(), threading.Event()

    def write() -> None:
        with store.write() as tx:
            tx.execute(CALLS.update().where(CALLS.c.key == "s/t/c1").values(status="failed"))
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=write)
    thread.start()
    try:
        assert inside.wait(10)
        started = time.monotonic()
        during = store.get_call("s/t/c1")
        assert time.monotonic() - started < 1.0
        assert during is not None and during.status == "queued"
    finally:
        release.set()
        thread.join(10)
    after = store.get_call("s/t/c1")
    assert after is not None and after.status == "failed"


def test_a_transaction_that_failed_does_not_leave_its_connection_held(store: Store) -> None:
    with store.write() as tx:
        held = _dbapi(tx)
    # When a transaction on the held connection fails
    with pytest.raises(RuntimeError), store.write() as tx:
        assert _dbapi(tx) is held
        tx.execute(text("SELECT 1"))
        raise RuntimeError("boom")
    # Then its connection went back to the pool, rolled back, and the next transaction takes
    # one from the pool; the write lock is free for another process
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    other = Store(store.url)
    try:
        assert other.insert_call(_row("s/t/c2"))
    finally:
        other.close()
    with store.write() as tx:
        assert tx.execute(select(CALLS.c.key)).scalars().all() == ["s/t/c2"]


def test_threads_that_overlap_each_get_a_connection_of_their_own(store: Store) -> None:
    # Given one thread inside a transaction on the held connection
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def hold() -> None:
        with store.read() as conn:
            seen["holder"] = _dbapi(conn)
            inside.set()
            release.wait(10)

    with store.read() as conn:
        held = _dbapi(conn)
    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(10)
    # When another thread reads meanwhile
    with store.read() as conn:
        seen["other"] = _dbapi(conn)
    release.set()
    thread.join(10)
    # Then it had a pooled connection of its own, never the one in use
    assert seen["holder"] is held
    assert seen["other"] is not held


def test_a_forked_child_never_uses_what_its_parent_held(store: Store) -> None:
    with store.write() as tx:
        tx.execute(text("SELECT 1"))
        parent_id = id(_dbapi(tx))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write a call through the store it inherited, report, exit
        code = 1
        try:
            with store.write() as tx:
                os.write(write, b"same" if id(_dbapi(tx)) == parent_id else b"own ")
            code = 0 if store.insert_call(_row("s/t/child")) else 2
        finally:
            os._exit(code)
    os.close(write)
    answer = os.read(read, 4)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    # Then the child opened its own connection, and its write landed
    assert answer == b"own "
    assert os.waitstatus_to_exitcode(status) == 0
    # And the parent's held connection still works
    with store.write() as tx:
        assert id(_dbapi(tx)) == parent_id
        assert tx.execute(select(CALLS.c.key)).scalars().all() == ["s/t/child"]


def test_close_returns_the_held_connections(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path}/dex.db")
    store.create_all()
    with store.write() as tx:
        tx.execute(text("SELECT 1"))
    with store.read() as conn:
        conn.execute(text("SELECT 1"))
    store.close()
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert store.read_engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_held_server_connection_closed_while_idle_is_replaced_before_use(
        postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Given a client's store (it pings what sat idle) whose held connection the server closes
    store = Store(postgres_url, ping_after_idle=0.0)
    store.create_all()
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with store.read() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        caplog.set_level(logging.WARNING, logger="dex_tasks.store")
        # When the next read runs
        with store.read() as conn:
            now = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        # Then it ran on a new connection at the first try: no statement failed and was
        # retried (the pool's own ping would have done the same for a pooled one)
        assert now != pid
        assert not [r for r in caplog.records if getattr(r, "action", "") == "store_retry"]
    finally:
        store.close()
        admin.dispose()


def test_a_held_connection_past_its_age_goes_back_to_be_recycled(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_: checkouts.append(1))
    try:
        aging, lasting = HeldConnection(engine, max_age=0.0), HeldConnection(engine)
        # When each runs three reads
        for held in (aging, lasting):
            checkouts.clear()
            for _ in range(3):
                with held.connect() as conn:
                    conn.execute(text("SELECT 1"))
            # Then the one past its age went back through the pool (which recycles what is
            # older than pool_recycle) every time, and the other one only the first time
            assert len(checkouts) == (3 if held is aging else 1)
        aging.close()
        lasting.close()
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_a_connection_made_read_only_by_a_read_is_not_held(postgres_url: str) -> None:
    # Given a store that keeps its connections, and a read that made its connection a
    # read-only REPEATABLE READ one (what an agent's session snapshot does)
    store = Store(postgres_url)
    store.create_all()
    try:
        def snapshot(conn: Any) -> Any:
            conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            return conn.execute(select(CALLS.c.key)).all()

        assert store.reading(snapshot) == []
        # When the next write runs, then it is not on that connection (it would be refused:
        # "cannot execute UPDATE in a read-only transaction"), and it lands
        assert store.insert_call(_row("s/t/c3"))
        with store.write() as tx:
            assert tx.execute(select(CALLS.c.key)).scalars().all() == ["s/t/c3"]
            assert tx.execute(text("SHOW transaction_read_only")).scalar_one() == "off"
    finally:
        store.close()


def test_a_held_connection_whose_session_the_server_ended_is_replaced_without_a_ping(
        postgres_url: str) -> None:
    # Given a worker's store (it pings nothing) whose held connection the server ends
    store = Store(postgres_url)
    store.create_all()
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with store.read() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            held = _dbapi(conn)
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            # (the server's goodbye reaches the socket once the backend has exited)
            for _ in range(200):
                gone = conn.execute(text("SELECT count(*) FROM pg_stat_activity "
                                         "WHERE pid = :pid"), {"pid": pid}).scalar_one()
                if not gone:
                    break
                time.sleep(0.01)
        # When the next read runs (store.read() does not retry)
        with store.read() as conn:
            now = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            replaced = _dbapi(conn) is not held
        # Then it ran on another connection, at the first try
        assert now != pid and replaced
    finally:
        store.close()
        admin.dispose()
