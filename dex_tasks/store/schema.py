"""The store's schema: Alembic migrations shipped in the package, the check every process makes
at start, and the migration of an empty database on first start.

Tables are built by the revisions in ``dex_tasks/store/migrations/versions`` only (no alembic.ini:
:func:`alembic_config` points Alembic into the package). ``0001_first_release`` is the schema
of the first release, which created its tables with ``create_all`` and recorded no version;
each later revision is one step towards ``models.py``. The revision a database is at is kept
in ``dex_schema_version``, a name of its own so that a database shared with an application
that uses Alembic too keeps both.

* :func:`prepare` is what every process does at start (``Store.create_all`` calls it: workers,
  beat, the API, ``DexClient(create_tables=True)``). A database at head: nothing to do (one
  read). An empty one: migrated to head. Anything else: :class:`SchemaOutOfDateError`, whose
  one-line message names ``dex-tasks db upgrade`` (or, for a schema newer than this release
  knows, the release to run).
* :func:`upgrade` is ``dex-tasks db upgrade``: a database of the first release (tables, no
  version) is stamped with the revision its tables match, then every missing revision runs.
* :func:`inspect_schema` is ``dex-tasks db current``.

Concurrent first starts: whatever may change the schema runs in one transaction that first
takes the schema lock. On PostgreSQL that is a transaction-scoped advisory lock: the others
wait for it, then read head and go on. On SQLite the store's write transaction begins with
``BEGIN IMMEDIATE``, which holds the database's write lock from the start. DDL is transactional
on both engines, so an upgrade that fails changes nothing.

A new revision: change ``models.py``, add ``versions/000N_<name>.py`` whose ``down_revision`` is
the current head (SQLite needs ``op.batch_alter_table`` for most ALTERs), and run
``tests/test_migrations.py``: :func:`differences` between the migrated database and the models
must be empty on both engines.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# Alembic announces its plugins (when imported) and its context (on every check) at INFO, which
# every process start would print: this module logs what the migrations did instead. Set before
# the imports below, which are the ones that log.
for _noisy in ("alembic.runtime.migration", "alembic.runtime.plugins"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.autogenerate import compare_metadata  # noqa: E402
from alembic.config import Config  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from sqlalchemy import inspect  # noqa: E402
from sqlalchemy.engine import Connection  # noqa: E402
from sqlmodel import SQLModel  # noqa: E402

import dex_tasks.store.models  # noqa: E402, F401 - the tables differences() compares against
from dex_tasks.errors import ConfigurationError, SchemaOutOfDateError  # noqa: E402
from dex_tasks.store.connections import lock_schema  # noqa: E402

log = logging.getLogger("dex_tasks.store.schema")

VERSION_TABLE = "dex_schema_version"
"""Where the database's revision is recorded."""

UPGRADE_COMMAND = "dex-tasks db upgrade"

# Alembic's running context is module-global: one migration per process at a time.
_ALEMBIC = threading.Lock()

# The tables of the first release; the second revision has these but dex_reconciliations.
_FIRST_RELEASE_TABLES = frozenset({
    "dex_tool_calls", "dex_call_events", "dex_interrupts", "dex_messages",
    "dex_tool_catalog", "dex_reconciliations",
})
_TRANSCRIPT_TABLES = _FIRST_RELEASE_TABLES - {"dex_reconciliations"}

State = Literal["head", "behind", "ahead", "empty", "unversioned"]


class SchemaStore(Protocol):
    """What this module needs of a store (``store.Store`` is one)."""

    @property
    def safe_url(self) -> str: ...

    def read(self) -> AbstractContextManager[Connection]: ...

    def write(self) -> AbstractContextManager[Connection]: ...


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database's schema stands against this release's migrations."""

    url: str
    revision: str | None
    """The revision recorded in the database; None when it records none."""
    head: str
    """The newest revision this release knows."""
    tables: frozenset[str]
    """dex-tasks' tables present."""
    known: bool
    """Whether this release knows ``revision``."""

    @property
    def state(self) -> State:
        """``head``; ``behind`` or ``unversioned`` (run ``db upgrade``); ``ahead`` (a newer
        release migrated it); ``empty`` (first start migrates it)."""
        if self.revision is None:
            return "unversioned" if self.tables else "empty"
        if self.revision == self.head:
            return "head"
        return "behind" if self.known else "ahead"

    def problem(self) -> str | None:
        """The one-line refusal for a process about to start; None at head (or empty)."""
        state = self.state
        if state == "behind":
            return (f"the store at {self.url} has schema revision {self.revision}, older than "
                    f"this dex-tasks needs ({self.head}): run `{UPGRADE_COMMAND}` (with the "
                    "same DEX_DATABASE_URL), then start again")
        if state == "unversioned":
            return (f"the store at {self.url} has tables from a dex-tasks release before "
                    f"schema migrations: run `{UPGRADE_COMMAND}` (with the same "
                    "DEX_DATABASE_URL), then start again")
        if state == "ahead":
            return (f"the store at {self.url} has schema revision {self.revision}, which this "
                    f"dex-tasks does not know (its newest is {self.head}): a newer release ran "
                    f"`{UPGRADE_COMMAND}` on it; run that release")
        return None


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic configuration for the migrations in this package (no alembic.ini)."""
    config = Config()
    config.set_main_option("script_location", "dex_tasks.store:migrations")
    config.attributes["version_table"] = VERSION_TABLE
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def script_directory() -> ScriptDirectory:
    """The revisions shipped with this release."""
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision this release knows."""
    head = script_directory().get_current_head()
    assert head is not None, "the migrations have one head"
    return head


def _status(conn: Connection, url: str) -> SchemaStatus:
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    heads = context.get_current_heads()
    revision = heads[0] if heads else None
    tables = frozenset(t for t in inspect(conn).get_table_names() if t.startswith("dex_")
                       and t != VERSION_TABLE)
    known = revision is not None and _is_known(script_directory(), revision)
    return SchemaStatus(url=url, revision=revision, head=head_revision(), tables=tables,
                        known=known)


def _is_known(script: ScriptDirectory, revision: str) -> bool:
    return revision in {r.revision for r in script.walk_revisions()}


def inspect_schema(store: SchemaStore) -> SchemaStatus:
    """Where the store's schema stands (``dex-tasks db current``); changes nothing."""
    with store.read() as conn:
        return _status(conn, store.safe_url)


@contextmanager
def _locked(store: SchemaStore) -> Iterator[Connection]:
    """A write transaction that holds the schema lock until it ends."""
    with store.write() as conn:
        lock_schema(conn)  # (SQLite: the write transaction began with BEGIN IMMEDIATE.)
        yield conn


def _migrate(conn: Connection, target: str, stamp: str | None = None) -> None:
    config = alembic_config(conn)
    with _ALEMBIC:
        if stamp is not None:
            command.stamp(config, stamp)
        command.upgrade(config, target)


def prepare(store: SchemaStore) -> bool:
    """Make sure the store's schema is this release's: what every process does at start.

    At head: nothing is written. Empty: migrated to head, by exactly one of the processes that
    start at once (True for that one). Otherwise raises :class:`SchemaOutOfDateError` (behind,
    from before migrations, or ahead), whose message says what to run.
    """
    if inspect_schema(store).state == "head":
        return False
    with _locked(store) as conn:
        # Read again under the lock: another process may have just migrated it.
        status = _status(conn, store.safe_url)
        if status.state == "empty":
            _migrate(conn, "head")
            log.info("empty database migrated to head",
                     extra={"action": "schema_created", "revision": status.head})
            return True
    problem = status.problem()
    if problem is not None:
        raise SchemaOutOfDateError(problem)
    return False


def upgrade(store: SchemaStore, revision: str = "head") -> tuple[SchemaStatus, SchemaStatus]:
    """Run every migration the store is missing, up to ``revision`` (``dex-tasks db upgrade``);
    returns the status before and after.

    A database the first release created (its tables, no recorded revision) is first stamped
    with the revision its tables match. One transaction under the schema lock: it completes,
    or changes nothing. Raises :class:`SchemaOutOfDateError` for a schema newer than this
    release knows, and :class:`~dex_tasks.errors.ConfigurationError` for tables that match no
    release.
    """
    with _locked(store) as conn:
        before = _status(conn, store.safe_url)
        if before.state == "ahead":
            raise SchemaOutOfDateError(before.problem() or "")
        stamp = _baseline(conn, before) if before.state == "unversioned" else None
        _migrate(conn, revision, stamp)
        after = _status(conn, store.safe_url)
    log.info("schema upgraded", extra={"action": "schema_upgraded", "from": before.revision,
                                       "to": after.revision, "stamped": stamp})
    return before, after


def _baseline(conn: Connection, status: SchemaStatus) -> str:
    """The revision an unversioned database's tables match."""
    if status.tables == _FIRST_RELEASE_TABLES:
        return "0001_first_release"
    columns = {c["name"] for c in inspect(conn).get_columns("dex_messages")} if (
        "dex_messages" in status.tables) else set()
    if status.tables == _TRANSCRIPT_TABLES and "role" in columns:
        return "0002_transcript"
    raise ConfigurationError(
        f"the store at {status.url} has dex-tasks tables ({', '.join(sorted(status.tables))}) "
        "that match no release: restore it from a backup, or point DEX_DATABASE_URL at the "
        "store your workers use"
    )


def differences(store: SchemaStore) -> list[Any]:
    """What Alembic's autogenerate finds between the store's tables and ``models.py`` (empty
    when the migrations build exactly the models)."""
    with store.read() as conn:
        context = MigrationContext.configure(conn, opts={
            "version_table": VERSION_TABLE,
            "compare_type": True,
            "compare_server_default": True,
            "include_name": lambda name, type_, _parent: (
                type_ != "table" or bool(name and name.startswith("dex_"))),
        })
        return list(compare_metadata(context, SQLModel.metadata))
