"""The connection a SQLite store keeps between transactions (``connections.HeldConnection``).

Most transactions of a process come one after another on one thread (a worker child's read
and ending, a producer's insert and ``wait``), so each takes the connection the last one left
instead of checking one out of SQLAlchemy's pool. These tests hold it to what the pool gave:
no transaction left open between uses (a read's snapshot would hide later writes, and a
held write lock would stop every other process), a failed connection never reused, nothing
shared across a fork, and none held past ``close``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path}/dex.db")
    s.create_all()
    yield s
    s.close()


def _row(key: str) -> dict[str, Any]:
    now = time.time()
    return {"key": key, "session_id": "s", "turn_id": "t", "tool_call_id": key.rsplit("/")[-1],
            "tool": "lookup", "arguments": "{}", "effect": "read", "requires_approval": False,
            "max_attempts": 3, "time_limit": None, "status": CallStatus.QUEUED.value,
            "published_at": now, "created_at": now, "updated_at": now}


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
