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
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, Store, driver
from dex_tasks.store.connections import retryable
from dex_tasks.store.tables import INSERT_CALL


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
