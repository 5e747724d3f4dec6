"""The store's hot path on SQLite's DB-API connection (``dex_tasks/store/driver.py``).

The claim, a call's moves and its insert are sent to ``sqlite3`` directly, compiled once from
the same Core statements PostgreSQL runs through SQLAlchemy. These tests hold that path to
what SQLAlchemy's own execution gives: the same rows and types, the same exceptions (which the
store's retries and its "key taken" answer are decided on), the same column defaults.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, Started, Store, driver
from dex_tasks.store.connections import retryable
from dex_tasks.store.tables import INSERT_CALL, MESSAGES


@pytest.fixture
def store(sqlite_store: Store) -> Store:
    return sqlite_store


def _row(key: str, **over: Any) -> dict[str, Any]:
    now = time.time()
    row: dict[str, Any] = {
        "key": key, "session_id": "s", "turn_id": "t", "tool_call_id": key.rsplit("/")[-1],
        "tool": "charge_card", "arguments": '{"amount_cents":5}', "effect": "read",
        "requires_approval": True, "max_attempts": 3, "time_limit": None,
        "status": CallStatus.QUEUED.value, "published_at": now, "created_at": now,
        "updated_at": now}
    row.update(over)
    return row


def test_a_claim_through_the_driver_returns_what_sqlalchemy_reads(store: Store) -> None:
    # Given a queued call (inserted without ``attempts``: its column default applies)
    assert store.insert_call(_row("s/t/c1"))
    # When a worker claims it (on SQLite, the claim's UPDATE goes through the driver)
    claimed = store.claim("s/t/c1", "w@h:1", 30.0, lambda row: row)
    assert claimed is not None
    row, vetted = claimed
    assert vetted is row
    # Then the row holds, with the same types, what SQLAlchemy reads back for the call
    with store.read() as conn:
        stored = conn.execute(select(CALLS).where(CALLS.c.key == "s/t/c1")).one()
    assert row._mapping == stored._mapping
    assert [type(v) for v in row] == [type(v) for v in stored]
    assert row.requires_approval is True and row.attempts == 1 and row.worker == "w@h:1"
    assert row.status == CallStatus.RUNNING.value and row.republishes == 0
    assert row.lease_expires_at > time.time() + 25


def test_a_taken_key_raises_sqlalchemys_integrity_error(store: Store) -> None:
    # Given a stored call
    assert store.insert_call(_row("s/t/c1"))
    # When the same key is inserted through the driver
    with pytest.raises(IntegrityError) as raised, store.write() as conn:
        driver.run(conn, INSERT_CALL, _row("s/t/c1"))
    # Then it is SQLAlchemy's IntegrityError, as Connection.execute raises it, so the store
    # answers "the key exists" and never retries it
    assert isinstance(raised.value.orig, sqlite3.IntegrityError)
    assert not retryable(raised.value, sqlite=True)
    assert store.insert_call(_row("s/t/c1")) is False


def test_a_locked_database_raises_an_error_the_store_retries(store: Store,
                                                             tmp_path: Path) -> None:
    # Given another connection holding SQLite's write lock
    other = sqlite3.connect(tmp_path / "dex.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with store.engine.connect() as conn:
            # When this connection asks for it without waiting
            driver.run_text(conn, "PRAGMA busy_timeout=0")
            with pytest.raises(OperationalError) as raised:
                driver.run_text(conn, "BEGIN IMMEDIATE")
            driver.run_text(conn, "PRAGMA busy_timeout=5000")
    finally:
        other.rollback()
        other.close()
    # Then the error is SQLAlchemy's OperationalError, which the store's retries take as
    # "busy, try again"
    assert "locked" in str(raised.value.orig)
    assert retryable(raised.value, sqlite=True)


def test_a_statement_that_expands_per_execution_is_refused(store: Store) -> None:
    # An IN list bound per execution cannot be compiled once: the driver says so rather than
    # send a statement with a placeholder it did not bind
    expanding = update(CALLS).where(CALLS.c.key.in_(bindparam("keys", expanding=True))) \
        .values(worker="x")
    with pytest.raises(TypeError, match="expands per execution"), store.write() as conn:
        driver.run(conn, expanding, {"keys": ["a", "b"]})


def test_a_missing_parameter_is_named(store: Store) -> None:
    stmt = update(CALLS).where(CALLS.c.key == bindparam("the_key")).values(worker="x")
    with pytest.raises(KeyError, match="the_key"), store.write() as conn:
        driver.run(conn, stmt, {})


def test_a_value_given_by_name_overrides_the_statements_own(store: Store) -> None:
    # Given a statement with a bound value of its own, as SQLAlchemy lets an execution
    # override by name
    assert store.insert_call(_row("s/t/c1"))
    stmt = update(CALLS).where(CALLS.c.key == bindparam("the_key")) \
        .values(worker=bindparam("the_worker", value="built-in"))
    with store.write() as conn:
        driver.run(conn, stmt, {"the_key": "s/t/c1"})
    assert (store.get_call("s/t/c1") or _row("x")).worker == "built-in"
    # When an execution gives that name, then its value is the one written
    with store.write() as conn:
        driver.run(conn, stmt, {"the_key": "s/t/c1", "the_worker": "given"})
    assert (store.get_call("s/t/c1") or _row("x")).worker == "given"


# -- a move's transaction, begun and committed on the DB-API connection ---------------------


def _started() -> Started:
    return Started(time.time(), {"attempt": 1, "worker": "w@h:1"})


def _lock_is_free(path: Path) -> bool:
    """Whether another connection can take SQLite's write lock without waiting."""
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.rollback()
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        other.close()


def test_a_move_commits_and_leaves_no_transaction_open(store: Store, tmp_path: Path) -> None:
    # Given a queued call whose attempt ran leased in Redis
    assert store.insert_call(_row("s/t/c1"))
    # When the attempt's ending is recorded (on SQLite, BEGIN and COMMIT go to the driver)
    assert store.transition("s/t/c1", CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                            match={"attempts": 0}, values={"attempts": 1, "result": "7"},
                            started=_started())
    # Then the move, both its events and its tool message are committed, and the write lock
    # is free for every other connection
    assert _lock_is_free(tmp_path / "dex.db")
    call = store.get_call("s/t/c1")
    assert call is not None and call.status == "succeeded" and call.result == "7"
    events = store.events_for_call("s/t/c1")[1:]  # after tool_call_requested
    assert [(e.event, e.from_status, e.to_status) for e in events] == [
        ("tool_call_started", "queued", "running"),
        ("tool_call_finished", "running", "succeeded")]
    assert events[0].id is not None and events[1].id is not None
    assert events[0].id < events[1].id
    with store.read() as conn:
        messages = conn.execute(select(MESSAGES.c.key, MESSAGES.c.tool_output)).all()
    assert [tuple(m) for m in messages] == [("s/t/c1", "7")]


def test_a_move_the_store_refuses_part_way_writes_nothing(store: Store,
                                                         tmp_path: Path) -> None:
    # Given a queued call, and a tool message already under its key (the unique index then
    # refuses the ending's own, after its UPDATE and its events were sent)
    assert store.insert_call(_row("s/t/c1"))
    with store.write() as conn:
        driver.run(conn, insert(MESSAGES), {"session_id": "s", "role": "tool",
                                            "created_at": time.time(), "key": "s/t/c1"})
    # When the ending is recorded, then it raises the driver's refusal...
    with pytest.raises(IntegrityError):
        store.transition("s/t/c1", CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                         match={"attempts": 0}, values={"attempts": 1, "result": "7"},
                         started=_started())
    # ...and nothing of it was written: the call is queued with no event of its ending, and
    # the lock is free
    assert _lock_is_free(tmp_path / "dex.db")
    call = store.get_call("s/t/c1")
    assert call is not None and call.status == "queued" and call.attempts == 0
    assert [e.event for e in store.events_for_call("s/t/c1")] == ["tool_call_requested"]
    # And the connection it used serves the next ending
    with store.write() as conn:
        conn.execute(delete(MESSAGES))
    assert store.transition("s/t/c1", CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                            match={"attempts": 0}, values={"attempts": 1, "result": "7"},
                            started=_started())


@pytest.mark.parametrize("fails", [False, True])
def test_a_statement_sent_through_sqlalchemy_joins_the_drivers_transaction(
        store: Store, tmp_path: Path, fails: bool) -> None:
    # Given two calls, and a transaction begun on the driver
    for key in ("s/t/c1", "s/t/c2"):
        assert store.insert_call(_row(key))
    stmt = update(CALLS).where(CALLS.c.key == bindparam("the_key")).values(worker="moved")

    def both() -> None:
        with store.committing(store.engine, on_driver=True) as conn:
            # When one statement goes to the driver and one through SQLAlchemy's execute
            driver.run(conn, stmt, {"the_key": "s/t/c1"})
            conn.execute(stmt, {"the_key": "s/t/c2"})
            if fails:
                raise RuntimeError("the block fails")

    if fails:
        with pytest.raises(RuntimeError):
            both()
    else:
        both()
    # Then both are one transaction: committed together, or rolled back together
    workers = {k: (store.get_call(k) or _row("x")).worker for k in ("s/t/c1", "s/t/c2")}
    assert workers == ({"s/t/c1": None, "s/t/c2": None} if fails
                       else {"s/t/c1": "moved", "s/t/c2": "moved"})
    assert _lock_is_free(tmp_path / "dex.db")


def test_an_insert_of_a_taken_key_writes_nothing_and_frees_the_lock(store: Store,
                                                                    tmp_path: Path) -> None:
    # Given a stored call
    assert store.insert_call(_row("s/t/c1"))
    # When another insert under its key is refused in its transaction (begun on the driver)
    assert store.insert_call(_row("s/t/c1", arguments='{"amount_cents":6}')) is False
    # Then nothing of it was written, and every other connection can write at once
    assert _lock_is_free(tmp_path / "dex.db")
    assert [e.event for e in store.events_for_call("s/t/c1")] == ["tool_call_requested"]
    assert (store.get_call("s/t/c1") or _row("x")).arguments == '{"amount_cents":5}'
    assert store.insert_call(_row("s/t/c2"))
