"""The store's PostgreSQL tests again, through PgBouncer in transaction mode (issue 30, item 1).

Every test of ``test_store.py`` and ``test_store_types.py`` that runs on a ``database_url``
runs here once more, on a fresh database reached through the run's PgBouncer
(``pool_mode = transaction``, Debian's 1.18: no prepared statements across transactions) with
``DEX_STORE_POOLER=transaction``: each transaction may run on another server session, shared
with other clients. Then what only a pooler shows: nothing a bounded transaction sets outlives
it on a server session, a store that does not know of the pooler refuses in one line naming
the setting, and many threads on few server sessions prepare nothing on the server.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import text

from dex_tasks import CallStatus, DexClient, StoreRefusedError, StoreUnavailableError
from dex_tasks.store import Store, bounded_statements
from tests import test_store, test_store_types
from tests.conftest import fast_settings
from tests.pgbouncer import PgBouncer, pgbouncer
from tests.test_store import call_row
from tests.test_store import store as store  # the fixtures, here on the pooled database
from tests.test_store_types import db_client as db_client
from workers import example_tools

# Registered in this process: the tests call them with no worker's catalog published.
assert example_tools.lookup_order

_ON_A_DATABASE = {"store", "database_url", "db_client"}


def _tests_on_a_database(module: ModuleType) -> dict[str, Any]:
    """The tests of ``module`` that take the store (or its URL) from ``database_url``."""
    return {name: value for name, value in vars(module).items()
            if name.startswith("test_") and callable(value)
            and _ON_A_DATABASE & set(inspect.signature(value).parameters)}


# Collected here again: pytest gives them this module's ``database_url``.
globals().update(_tests_on_a_database(test_store))
globals().update(_tests_on_a_database(test_store_types))


@pytest.fixture
def database_url(pooled_postgres_url: str) -> str:
    """Every store test of this module runs on a database behind the transaction pooler."""
    return pooled_postgres_url


def test_the_store_test_sets_are_collected_here() -> None:
    # (A rename in those modules must not quietly leave this module with nothing to run.)
    assert len(_tests_on_a_database(test_store)) >= 20
    assert len(_tests_on_a_database(test_store_types)) >= 5


def test_bounded_moves_leave_nothing_on_the_server_sessions(
        redis_url: str, pooled_postgres_url: str, pooler: PgBouncer) -> None:
    # Given a running call whose row another client's transaction holds locked
    with DexClient(fast_settings(redis_url, pooled_postgres_url)) as client:
        record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        store = Store(pooled_postgres_url, retry_seconds=1.0)
        assert store.pooler
        holder = store.engine.connect()
        try:
            assert store.claim(record.key, "node:1", 30, lambda row: None) is not None
            holder.execute(text("SELECT 1 FROM dex_tool_calls WHERE key = :k FOR UPDATE"),
                           {"k": record.key})
            # When a sweep ends it under its bounds (a one-statement move, which the store
            # runs in a short transaction under bounds: SET LOCAL, nothing on the session)
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="lock timeout"):
                with bounded_statements(20, 0.2):
                    store.transition(record.key, CallStatus.OUTCOME_UNKNOWN,
                                     allowed={CallStatus.RUNNING}, values={"error": "lost"})
            # Then it gave up within its retries instead of queueing behind the lock
            assert time.monotonic() - started < 5
            holder.rollback()
            with bounded_statements(20, 0.2):
                assert store.transition(record.key, CallStatus.OUTCOME_UNKNOWN,
                                        allowed={CallStatus.RUNNING},
                                        values={"error": "lost"})
            # And no server session the pooler hands out carries a bound: as many
            # transactions held open at once as the database has server sessions each take
            # one of their own, so together they see every session the moves could have used
            with store.engine.connect() as conn:
                sessions = conn.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND backend_type = 'client backend'")).scalar_one()
            held = [store.engine.connect() for _ in range(sessions)]
            try:
                seen = {conn.execute(text(
                    "SELECT pg_backend_pid()::text || ' ' || current_setting('lock_timeout') "
                    "|| ' ' || current_setting('statement_timeout')")).scalar_one()
                    for conn in held}
                assert len(seen) == sessions >= 2
                assert {s.split(" ", 1)[1] for s in seen} == {"0 0"}, seen
            finally:
                for conn in held:
                    conn.close()
        finally:
            holder.close()
            store.close()


def test_many_threads_on_few_server_sessions_prepare_nothing(pooled_postgres_url: str) -> None:
    # Given a pooler with two server sessions for this database and a store of many threads
    with pgbouncer(settings={"default_pool_size": "2"}) as narrow:
        url = narrow.url(pooled_postgres_url)
        store = Store(url, retry_seconds=10.0)
        store.create_all()
        errors: list[BaseException] = []

        def calls(worker: int) -> None:
            try:
                for i in range(15):
                    key = f"s{worker}/t/c{i}"
                    assert store.insert_call(call_row(key))
                    assert store.claim(key, f"node:{worker}", 30, lambda row: None)
                    assert store.transition(key, CallStatus.SUCCEEDED,
                                            allowed={CallStatus.RUNNING},
                                            values={"result": "1"})
                    assert store.get_call(key) is not None
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        # When they run the hot path's same few statements over and over (psycopg would
        # prepare each after its second run on a connection)
        threads = [threading.Thread(target=calls, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        # Then every statement ran on whichever server session the pooler gave it
        assert errors == []
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM dex_tool_calls "
                                     "WHERE status = 'succeeded'")).scalar_one() == 90
            assert conn.execute(text("SELECT count(*) FROM pg_prepared_statements")
                                ).scalar_one() == 0
        store.close()


@pytest.fixture
def unannounced(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh database behind a pooler that drops startup options, with no
    ``DEX_STORE_POOLER`` set."""
    monkeypatch.delenv("DEX_STORE_POOLER", raising=False)
    with pgbouncer(settings={"ignore_startup_parameters": "extra_float_digits, options"}) as b:
        yield b.url(postgres_url)


def test_a_store_that_does_not_know_of_the_pooler_refuses_naming_the_setting(
        unannounced: str) -> None:
    # Given a pooler that silently drops the startup options (so psycopg's prepared
    # statements would later go missing between transactions)
    store = Store(unannounced)
    # When the store first connects, then it refuses at once, naming the setting
    started = time.monotonic()
    with pytest.raises(StoreRefusedError, match="set DEX_STORE_POOLER=transaction") as err:
        store.create_all()
    assert time.monotonic() - started < 5
    assert "ignored the startup options" in str(err.value) and "\n" not in str(err.value)
    store.close()
    # And told, it works through the same pooler
    told = Store(unannounced, pooler=True)
    told.create_all()
    assert told.insert_call(call_row("s/t/c"))
    told.close()
