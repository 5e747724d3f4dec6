"""Schema migrations on SQLite and PostgreSQL: the first revision is the first release's schema,
an upgrade keeps that release's data readable, head is exactly ``models.py``, first starts are
safe when they race, and processes refuse a schema that is not theirs.

The first release's tables come from that release's own ``create_all`` (``tests/legacy``), run
in a process of its own.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import MetaData, create_engine, insert, inspect, text

from dex_tasks import DexClient, MessageRole, SchemaOutOfDateError
from dex_tasks.errors import ConfigurationError
from dex_tasks.states import CallStatus
from dex_tasks.store import Store, schema
from dex_tasks.store.catalog import entry_for
from dex_tasks.worker.reconcilers import unreported_calls
from tests.conftest import POSTGRES_URL, fast_settings, settings_env
from tests.helpers import (
    ROOT,
    WorkerProcess,
    dex_command,
    race_in_processes,
    start_process,
)
from workers import example_tools

LEGACY = ROOT / "tests" / "legacy" / "create_c28862d.py"
FIRST = "0001_first_release"
TRANSCRIPT = "0002_transcript"

NewDatabase = Callable[[], str]


@pytest.fixture(params=["sqlite", "postgres"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NewDatabase]:
    """Empty databases of one engine, as many as the test asks for; dropped afterwards."""
    made: list[str] = []
    counter = itertools.count()
    if request.param == "postgres" and not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("DEX_TEST_POSTGRES_URL must be set on CI")
        pytest.skip("DEX_TEST_POSTGRES_URL is not set")
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT") if (
        request.param == "postgres") else None

    def new() -> str:
        if admin is None:
            return f"sqlite:///{tmp_path / f'db{next(counter)}.sqlite'}"
        name = f"dex_test_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        made.append(name)
        return f"{POSTGRES_URL.rpartition('/')[0]}/{name}"

    yield new
    if admin is not None:
        with admin.connect() as conn:
            for name in made:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def legacy_create_all(url: str) -> None:
    """The first release's start-up: ``create_all`` of its models (no version recorded)."""
    subprocess.run([sys.executable, str(LEGACY), url], check=True, cwd=LEGACY.parent,
                   timeout=60)


def reflect(url: str) -> dict[str, Any]:
    """What a database holds of dex-tasks: each table's columns (in order, with type,
    nullability and default), primary key, indexes and unique constraints."""
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return {
            table: {
                "columns": [(c["name"], str(c["type"]), c["nullable"], c.get("default"))
                            for c in found.get_columns(table)],
                "primary_key": found.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                                  for i in found.get_indexes(table)),
                "unique": sorted(tuple(u["column_names"])
                                 for u in found.get_unique_constraints(table)),
            }
            for table in sorted(found.get_table_names())
            if table.startswith("dex_") and table != schema.VERSION_TABLE
        }
    finally:
        engine.dispose()


def migrate(url: str, revision: str) -> None:
    store = Store(url)
    try:
        schema.upgrade(store, revision)
    finally:
        store.close()


def dex(args: list[str], url: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``dex-tasks ARGS`` against ``url`` and wait for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
    env["DEX_DATABASE_URL"] = url
    return subprocess.run([*dex_command(), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# -- the first revision, and the way back to it -------------------------------------------------


def test_first_revision_is_the_first_release_schema_and_downgrades_return_to_it(
    new_database: NewDatabase,
) -> None:
    # Given one database built by the first revision and one by the first release itself
    migrated, released = new_database(), new_database()
    migrate(migrated, FIRST)
    legacy_create_all(released)
    # Then they hold the same tables, columns (in order), keys and indexes
    first_release = reflect(released)
    assert set(first_release) == {"dex_tool_calls", "dex_call_events", "dex_interrupts",
                                  "dex_messages", "dex_tool_catalog", "dex_reconciliations"}
    assert reflect(migrated) == first_release

    # And going to head and all the way back down rebuilds the first release's schema
    migrate(migrated, "head")
    assert reflect(migrated) != first_release
    store = Store(migrated)
    try:
        with store.write() as conn:
            command.downgrade(schema.alembic_config(conn), FIRST)
        assert schema.inspect_schema(store).revision == FIRST
    finally:
        store.close()
    assert reflect(migrated) == first_release


def test_head_is_exactly_the_models(new_database: NewDatabase) -> None:
    # Given an empty database started the way every process starts
    store = Store(new_database())
    try:
        assert schema.inspect_schema(store).state == "empty"
        store.create_all()
        # Then it is at head, and autogenerate finds nothing between it and models.py
        status = schema.inspect_schema(store)
        assert (status.state, status.revision) == ("head", schema.head_revision())
        assert schema.differences(store) == []
        # And the redundant index on status alone is gone; the composite ones stay
        indexes = {tuple(i["column_names"]): i["name"]
                   for i in inspect(store.engine).get_indexes("dex_tool_calls")}
        assert ("status",) not in indexes
        assert {("status", "lease_expires_at"), ("status", "published_at"),
                ("status", "finished_at")} <= set(indexes)
        # And a second start changes nothing
        assert schema.prepare(store) is False
    finally:
        store.close()


# -- upgrading a first-release database with data in it ------------------------------------------

OLD = time.time() - 3 * 86400
SESSION = "s-old"


def _call(turn: str, status: CallStatus, tool: str = "lookup_order", **over: Any) -> dict[str, Any]:
    key = f"{SESSION}/{turn}/c1"
    row: dict[str, Any] = {
        "key": key, "session_id": SESSION, "turn_id": turn, "tool_call_id": "c1",
        "tool": tool, "arguments": '{"order_id": "1001"}', "effect": "read",
        "requires_approval": False, "max_attempts": 3, "time_limit": None,
        "status": status.value, "prev_status": None, "result": None, "error": None,
        "attempts": 1, "interrupt_id": None, "worker": None, "lease_expires_at": None,
        "published_at": OLD, "republishes": 0, "expires_at": None, "created_at": OLD,
        "updated_at": OLD + 1, "finished_at": OLD + 1 if status.terminal else None,
    }
    row.update(over)
    return row


FIRST_RELEASE_CALLS = [
    _call("t1", CallStatus.AWAITING_APPROVAL, "refund_payment", attempts=0,
          arguments='{"amount_cents": 500, "charge_id": "ch_1"}', effect="non_idempotent_write",
          requires_approval=True, max_attempts=1, interrupt_id="i-wait", published_at=None),
    _call("t2", CallStatus.QUEUED, attempts=0),
    _call("t3", CallStatus.RUNNING, worker="dex-1@h:11", lease_expires_at=OLD + 30),
    _call("t4", CallStatus.SUCCEEDED, result='{"order_id": "1001", "status": "shipped"}'),
    _call("t5", CallStatus.FAILED, error="LookupError: order 9 does not exist"),
    _call("t6", CallStatus.REJECTED, "refund_payment", effect="non_idempotent_write",
          requires_approval=True, max_attempts=1, attempts=0, interrupt_id="i-no",
          error="APPROVAL_REJECTED: the tool did not run; rejected by alice: too much"),
    _call("t7", CallStatus.OUTCOME_UNKNOWN, "charge_card", effect="non_idempotent_write",
          max_attempts=1, error="OUTCOME_UNKNOWN_TOOL_RESULT: the worker was lost"),
    _call("t8", CallStatus.OUTCOME_UNKNOWN, "charge_card", effect="non_idempotent_write",
          max_attempts=1, error="OUTCOME_UNKNOWN_TOOL_RESULT: the worker was lost"),
]
ENDED = {row["key"]: row for row in FIRST_RELEASE_CALLS if CallStatus(row["status"]).terminal}
REPORT = f"The charge went through. (tool call {SESSION}/t7/c1)"


def fill_first_release(url: str) -> dict[str, int]:
    """Rows as the first release wrote them; returns the user messages' ids by text."""
    engine = create_engine(url)
    tables = MetaData()
    tables.reflect(engine)
    try:
        with engine.begin() as conn:
            conn.execute(insert(tables.tables["dex_tool_calls"]), FIRST_RELEASE_CALLS)
            conn.execute(insert(tables.tables["dex_interrupts"]), [
                {"interrupt_id": "i-wait", "key": f"{SESSION}/t1/c1", "session_id": SESSION,
                 "deadline_at": None, "created_at": OLD, "decision": None,
                 "decided_by": None, "decided_at": None, "reason": None},
                {"interrupt_id": "i-no", "key": f"{SESSION}/t6/c1", "session_id": SESSION,
                 "deadline_at": None, "created_at": OLD, "decision": "rejected",
                 "decided_by": "alice", "decided_at": OLD + 1, "reason": "too much"},
            ])
            conn.execute(insert(tables.tables["dex_call_events"]), [
                {"session_id": SESSION, "key": row["key"], "event": "tool_call_requested",
                 "from_status": None, "to_status": "queued", "detail": None, "created_at": OLD}
                for row in FIRST_RELEASE_CALLS
            ] + [
                # A diagnostic that quotes a tool's message with a NUL in it: jsonb refuses
                # \u0000, so the upgrade must keep the row readable anyway.
                {"session_id": SESSION, "key": f"{SESSION}/t5/c1", "event": "tool_call_finished",
                 "from_status": "running", "to_status": "failed",
                 "detail": '{"reason": "tool_error", "error": "bad\\u0000byte"}',
                 "created_at": OLD + 1},
            ])
            ids = {}
            for message, status in (("hello", "delivered"), ("one more thing", "queued"),
                                    (REPORT, "delivered")):
                ids[message] = conn.execute(insert(tables.tables["dex_messages"]).values(
                    session_id=SESSION, text=message, status=status, created_at=OLD + 0.5,
                    delivered_at=OLD + 0.5 if status == "delivered" else None,
                ).returning(tables.tables["dex_messages"].c.id)).scalar_one()
            conn.execute(insert(tables.tables["dex_reconciliations"]).values(
                key=f"{SESSION}/t7/c1", session_id=SESSION, message_id=ids[REPORT],
                checker="check", report=REPORT, reported_at=OLD + 2))
            conn.execute(insert(tables.tables["dex_tool_catalog"]),
                         [entry_for(example_tools.lookup_order, OLD)])
    finally:
        engine.dispose()
    return ids


def test_a_first_release_database_upgrades_with_its_data(
    new_database: NewDatabase, redis_url: str
) -> None:
    # Given the first release's database with a call of each status, interrupts, events, user
    # messages (one of them a report of an unknown outcome) and a catalog entry
    url = new_database()
    legacy_create_all(url)
    message_ids = fill_first_release(url)
    settings = fast_settings(redis_url, url)

    # When a process of this release starts on it, it refuses, naming the command
    with pytest.raises(SchemaOutOfDateError,
                       match=r"before schema migrations: run `dex-tasks db upgrade`"):
        DexClient(settings)
    assert "run `dex-tasks db upgrade`" in dex(["db", "current"], url).stdout

    # When the operator runs the upgrade
    done = dex(["db", "upgrade"], url)
    assert done.returncode == 0, done.stderr
    assert f"upgraded from unversioned to head {schema.head_revision()}" in done.stdout
    current = dex(["db", "current"], url)
    assert (current.returncode, current.stdout.strip()) == (
        0, f"{Store(url).safe_url}: {schema.head_revision()} (head)")

    with DexClient(settings) as client:
        # Then the schema is exactly this release's
        assert schema.differences(client.store) == []
        # And every call reads back as it was
        snapshot = client.get_agent_snapshot(SESSION)
        assert [(c.key, c.status.value) for c in snapshot.tool_calls] == [
            (row["key"], row["status"]) for row in FIRST_RELEASE_CALLS]
        by_key = {c.key: c for c in snapshot.tool_calls}
        assert by_key[f"{SESSION}/t4/c1"].result == {"order_id": "1001", "status": "shipped"}
        assert by_key[f"{SESSION}/t1/c1"].arguments == {"amount_cents": 500, "charge_id": "ch_1"}
        assert [p.interrupt_id for p in snapshot.pending_interrupts] == ["i-wait"]
        assert [(d.interrupt_id, d.decided_by) for d in snapshot.decided] == [("i-no", "alice")]

        # And the user messages keep their ids, text and status, now with role "user"
        users = [m for m in snapshot.messages if m.role is MessageRole.USER]
        assert [(m.id, m.text, m.status) for m in users] == [
            (message_ids["hello"], "hello", "delivered"),
            (message_ids["one more thing"], "one more thing", "queued"),
            (message_ids[REPORT], REPORT, "delivered")]
        # And each call that had ended has its tool message, as the transition would write it
        tools = {m.key: m for m in snapshot.messages if m.role is MessageRole.TOOL}
        assert set(tools) == set(ENDED)
        for key, row in ENDED.items():
            message = tools[key]
            assert message.call_status is not None
            assert message.call_status.value == row["status"]
            assert message.created_at.timestamp() == pytest.approx(row["finished_at"])
            assert (message.turn_id, message.tool_call_id, message.tool) == (
                row["turn_id"], "c1", row["tool"])
            assert json.loads(message.tool_arguments or "") == json.loads(row["arguments"])
            if row["status"] == "succeeded":
                assert json.loads(message.tool_output or "") == json.loads(row["result"])
            else:
                assert message.tool_output == row["error"]
        assert min(m.id for m in tools.values()) > max(message_ids.values())

        # And the events read back, the one quoting a NUL included
        events = client.events(SESSION)
        assert len(events) == len(FIRST_RELEASE_CALLS) + 1
        detail = events[-1].detail or {}
        assert detail["reason"] == "tool_error" and detail["error"].startswith("bad")
        # And the catalog still answers
        assert "lookup_order" in [t.name for t in client.list_tools()]
        # And reconciliation still knows which unknown outcome was reported (the report is a
        # user message naming the key, as the first release wrote it)
        assert [c.key for c in unreported_calls(client.store)] == [f"{SESSION}/t8/c1"]

        # And calls carry on under this release: the running call ends, the queued one
        # fails, the approval waiting since the first release is rejected; each gets its tool
        # message, and the message queued behind those open turns is delivered
        assert client.store.transition(f"{SESSION}/t3/c1", CallStatus.SUCCEEDED,
                                       values={"result": '{"ok":true}'})
        assert client.store.transition(f"{SESSION}/t2/c1", CallStatus.FAILED,
                                       values={"error": "expired"})
        assert client.resolve_interrupt(SESSION, "i-wait", approved=False, approver="bob")
        after = client.get_agent_snapshot(SESSION)
        assert {m.key for m in after.messages if m.role is MessageRole.TOOL} == (
            {row["key"] for row in FIRST_RELEASE_CALLS})
        assert [m.status for m in after.messages if m.text == "one more thing"] == ["delivered"]
        new = client.call_tool(session_id="s-new", turn_id="t1", tool_call_id="c1",
                               tool="lookup_order", arguments={"order_id": "1001"})
        assert new.status is CallStatus.QUEUED


def test_a_failed_upgrade_changes_nothing(new_database: NewDatabase) -> None:
    # Given a first-release database, and something in it that makes the second revision fail
    # part-way: a view over the table it drops on PostgreSQL; on SQLite, a table in the way of
    # the copy its batch mode makes
    url = new_database()
    legacy_create_all(url)
    fill_first_release(url)
    before = reflect(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("CREATE VIEW reports AS SELECT * FROM dex_reconciliations"))
        else:
            conn.execute(text("CREATE TABLE _alembic_tmp_dex_messages (id INTEGER)"))
    engine.dispose()
    # When the upgrade runs, it fails
    failed = dex(["db", "upgrade"], url)
    assert failed.returncode != 0
    # Then the database is as it was: no revision recorded, no table changed, no row added
    assert reflect(url) == before
    store = Store(url)
    try:
        assert schema.inspect_schema(store).state == "unversioned"
        with store.read() as conn:
            assert conn.execute(text("SELECT count(*) FROM dex_messages")).scalar_one() == 3
    finally:
        store.close()


def test_tables_that_match_no_release_are_refused(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE dex_tool_calls (key VARCHAR(512) PRIMARY KEY)"))
    engine.dispose()
    store = Store(sqlite_url)
    try:
        with pytest.raises(ConfigurationError, match="match no release"):
            schema.upgrade(store)
        assert schema.inspect_schema(store).state == "unversioned"
    finally:
        store.close()


# -- first starts at once ----------------------------------------------------------------------


def _first_start(url: str, go: Any, out: Any) -> None:
    store = Store(url)
    try:
        go.wait(30)
        out.put(("migrated" if schema.prepare(store) else "found head", None))
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(err)))
    finally:
        store.close()


def test_four_first_starts_at_once_migrate_once(new_database: NewDatabase) -> None:
    # Given an empty database and four processes starting on it at the same moment
    url = new_database()
    results = sorted(race_in_processes(_first_start, [(url,)] * 4))
    # Then exactly one migrated, the others waited and found head, and nothing failed
    assert results == [("found head", None)] * 3 + [("migrated", None)], results
    store = Store(url)
    try:
        assert schema.inspect_schema(store).state == "head"
        assert schema.differences(store) == []
        with store.read() as conn:
            versions = conn.execute(text(f"SELECT count(*) FROM {schema.VERSION_TABLE}"))
            assert versions.scalar_one() == 1
    finally:
        store.close()


def test_two_workers_started_at_once_on_a_fresh_postgres_database(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    url = postgres_url
    # Given two workers started together on an empty PostgreSQL database
    env = settings_env(fast_settings(redis_url, url))
    workers = [WorkerProcess(start_process(["worker", "--tools", "workers.example_tools"],
                                           env, tmp_path / f"w{i}.log"), tmp_path / f"w{i}.log")
               for i in range(2)]
    try:
        # Then both come up, and calls run on the schema one of them built
        for worker in workers:
            worker.wait_ready(60)
        with DexClient(fast_settings(redis_url, url)) as client:
            record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                      tool="lookup_order", arguments={"order_id": "1001"})
            assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED
            assert schema.differences(client.store) == []
    finally:
        for worker in workers:
            worker.discard()


# -- processes refuse a schema that is not theirs ----------------------------------------------


def test_worker_beat_and_api_refuse_an_out_of_date_schema(
    sqlite_url: str, redis_url: str, tmp_path: Path
) -> None:
    # Given a store one revision behind this release
    migrate(sqlite_url, TRANSCRIPT)
    env = settings_env(fast_settings(redis_url, sqlite_url))
    commands = {"worker": ["worker", "--tools", "workers.example_tools"], "beat": ["beat"],
                "api": ["api", "--port", "1"]}

    def refusals(names: tuple[str, ...] = ("worker", "beat", "api")) -> dict[str, str]:
        procs = {name: start_process(commands[name], env, tmp_path / f"{name}.log")
                 for name in names}
        out = {}
        for name, proc in procs.items():
            assert proc.wait(60) == 2, (tmp_path / f"{name}.log").read_text()
            out[name] = (tmp_path / f"{name}.log").read_text()
            (tmp_path / f"{name}.log").unlink()
        return out

    # When a worker, beat and the API start on it, each exits with one line that says what
    # to run, and no traceback
    for name, output in refusals().items():
        lines = output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in output, (name, output)
        assert lines[0].startswith("error: the store at sqlite:///"), (name, output)
        assert f"schema revision {TRANSCRIPT}" in lines[0], (name, output)
        assert "run `dex-tasks db upgrade`" in lines[0], (name, output)
    # And a client asked to create the tables raises the same error; one told not to, does not
    with pytest.raises(SchemaOutOfDateError, match="dex-tasks db upgrade"):
        DexClient(fast_settings(redis_url, sqlite_url))
    DexClient(fast_settings(redis_url, sqlite_url), create_tables=False).close()

    # Given a store a newer release migrated (a revision this one does not know)
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {schema.VERSION_TABLE} SET version_num = '0099_future'"))
    engine.dispose()
    # Then a worker refuses too (the same check as beat's and the API's), saying so
    for name, output in refusals(("worker",)).items():
        assert "revision 0099_future, which this dex-tasks does not know" in output, name
        assert "a newer release ran `dex-tasks db upgrade` on it" in output, name
    current = dex(["db", "current"], sqlite_url)
    assert current.returncode == 1 and "a newer release migrated it" in current.stdout
    upgrade = dex(["db", "upgrade"], sqlite_url)
    assert upgrade.returncode == 2 and "does not know" in upgrade.stderr


# -- the package ---------------------------------------------------------------------------------


def test_the_wheel_ships_the_migrations(tmp_path: Path) -> None:
    # Given a wheel built from the sources
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "beat_schedule.py"):
        shutil.copy(ROOT / name, source / name)
    for package in ("dex_tasks", "workers"):
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("dex_tasks-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"dex_tasks/store/migrations/env.py", "dex_tasks/store/migrations/script.py.mako",
            "dex_tasks/store/migrations/versions/0001_first_release.py"} <= names
    # When it is unpacked and imported from anywhere but the source tree
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    found = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); import dex_tasks.store.schema as s; "
         "print(s.__file__); print(s.head_revision())", str(unpacked)],
        capture_output=True, text=True, cwd=tmp_path, timeout=60)
    # Then Alembic finds every revision inside the package, with no alembic.ini
    assert found.returncode == 0, found.stderr
    where, head = found.stdout.split()
    assert where.startswith(str(unpacked)) and head == schema.head_revision()


def test_db_current_on_an_empty_database(sqlite_url: str) -> None:
    current = dex(["db", "current"], sqlite_url)
    assert current.returncode == 1
    assert "no schema yet" in current.stdout and "dex-tasks db upgrade" in current.stdout
