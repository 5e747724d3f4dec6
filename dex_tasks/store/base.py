"""The store's connections: engines, transactions, retries across a lost connection, hooks.

:class:`StoreBase` is what every part of :class:`~dex_tasks.store.Store` builds on: a write
transaction hands the calls it ended to the ``on_calls_ended`` hooks once it has committed
(never before: that is how waiters are woken and ended calls counted, ``broker/announce.py``,
with no Redis import here), and ``_retrying`` runs an operation again on a new connection
while the error is one a retry can cure.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from dex_tasks.errors import StoreRefusedError, StoreUnavailableError
from dex_tasks.settings import DexSettings
from dex_tasks.states import CallStatus
from dex_tasks.store.connections import (
    DRIVER_TRANSACTION,
    FORK_GUARD,
    RECYCLE,
    NetworkBounds,
    retryable,
    server_engine,
    sqlite_begin,
    sqlite_engine,
    statements_bounded,
)
from dex_tasks.store.driver import run_text
from dex_tasks.store.held import HeldConnection
from dex_tasks.store.records import RECORD_COLUMNS
from dex_tasks.store.refusals import refusal
from dex_tasks.store.tables import STORE_NOW

log = logging.getLogger("dex_tasks.store")

T = TypeVar("T")

# Retrying a transaction across a reconnect: the first pause, and the longest.
RETRY_FIRST_PAUSE = 0.05
RETRY_MAX_PAUSE = 0.5


@dataclass(frozen=True)
class EndedCall:
    """A call a committed transaction ended: what the ``on_calls_ended`` hooks are given."""

    key: str
    session_id: str
    tool: str
    effect: str
    status: CallStatus
    created_at: float
    finished_at: float
    record: str | None = None
    """The ended call's record as JSON text (its :data:`~dex_tasks.store.records.RECORD_COLUMNS`),
    when the statement that ended it returned them: what the notification that wakes its
    waiters hands them, signed as it is (``broker/ended.py``)."""
    worker: str | None = None
    """The worker the ended row names (the attempt that ended it), if any."""


EndedHook = Callable[[Sequence[EndedCall]], None]

# Where a write transaction collects the calls it ends, until it has committed (conn.info).
ENDED_CALLS = "dex_ended_calls"


# Where a write transaction collects what to do once it has committed (conn.info).
AFTER_COMMIT = "dex_after_commit"


def after_commit(conn: Connection, action: Callable[[], None]) -> None:
    """Run ``action`` once this write transaction has committed (never if it rolls back);
    guarded like the ``on_calls_ended`` hooks. The webhook outbox publishes its deliveries so
    (``store/webhooks.py``)."""
    actions = conn.info.get(AFTER_COMMIT)
    if actions is not None:
        actions.append(action)


def note_ended(conn: Connection, key: str, to: CallStatus, row: Any, now: float) -> None:
    """Remember that this transaction ends call ``key`` (``row``: what its UPDATE returned),
    for the hooks that run once it has committed (see :meth:`Store.committing`)."""
    ended = conn.info.get(ENDED_CALLS)
    if ended is not None:
        ended.append(EndedCall(key=key, session_id=row.session_id, tool=row.tool,
                               effect=row.effect, status=to, created_at=row.created_at,
                               finished_at=now, record=_record_text(row),
                               worker=row.worker))


def _record_text(row: Any) -> str | None:
    """The ended call's record as JSON text: the text the statement built (PostgreSQL's
    one-statement move returns it as ``record``, ``moves.single_statement``), or the record's
    columns of a whole row written out; None if ``row`` has neither."""
    fields = getattr(row, "_fields", None)
    if fields is not None:
        # A returned row's type says once which columns all its rows have (every ending of
        # a worker asks this of a row of the same type).
        kind = _record_kind(fields)
        if kind == "text":
            return row.record  # type: ignore[no-any-return]
        if kind is None:
            return None
        mapping = row._mapping
    else:
        mapping = getattr(row, "_mapping", None)
        if mapping is None or any(name not in mapping for name in RECORD_COLUMNS):
            return None
    return json.dumps({name: mapping[name] for name in RECORD_COLUMNS})


@functools.lru_cache(maxsize=64)
def _record_kind(fields: tuple[str, ...]) -> str | None:
    """How a row with these column names holds its call's record: as JSON text ("text"),
    as columns ("columns"), or not at all (None)."""
    if "record" in fields:
        return "text"
    return "columns" if set(RECORD_COLUMNS) <= set(fields) else None


class StoreBase:
    """Access to the SQL store. Safe across fork: a child opens connections of its own.

    ``retry_seconds`` bounds how long the store's own operations (transitions, the claim,
    lease renewals, single-call reads and inserts) keep trying across lost connections and a
    busy database. ``ping_after_idle`` tests a pooled server connection that sat idle that
    many seconds before using it; for processes that idle (see
    ``connections.server_engine``). ``network``: how long a server connection may hang on a
    silent network (default: what ``DEX_STORE_*`` give, ``connections.NetworkBounds``).
    ``pooler``: a transaction pooler is in front of the server (default: what
    ``DEX_STORE_POOLER`` says; see ``connections.server_engine``). ``hold_connections``:
    each engine's last connection is kept for the next transaction of this process
    (``held.HeldConnection``; off, every transaction checks one out of the pool).

    An error that waiting cannot fix (a refused login, a database that does not exist, a
    pooler refusing a startup parameter: ``refusals.refusal``) is never retried: it raises
    :class:`StoreRefusedError` at once, one line naming the cause and the fix.
    """

    def __init__(self, database_url: str, *, retry_seconds: float = 5.0,
                 ping_after_idle: float | None = None,
                 network: NetworkBounds | None = None, pooler: bool | None = None,
                 hold_connections: bool = True) -> None:
        self.url = database_url
        self.retry_seconds = retry_seconds
        self.is_sqlite = database_url.startswith("sqlite")
        if self.is_sqlite:
            self.pooler = False
            self.engine = sqlite_engine(database_url, immediate=True)
            self.read_engine = sqlite_engine(database_url, immediate=False)
        else:
            self.pooler = (DexSettings().store_pooler == "transaction" if pooler is None
                           else pooler)
            self.engine = server_engine(database_url, ping_after_idle=ping_after_idle,
                                        network=network, pooler=self.pooler)
            self.read_engine = self.engine
        self.is_postgres = self.engine.dialect.name == "postgresql"
        # PostgreSQL's hot-path writes are one statement each (a data-modifying CTE), run in
        # autocommit: one round trip, no BEGIN and no COMMIT of their own (``single=True``).
        self.autocommit_engine = (self.engine.execution_options(isolation_level="AUTOCOMMIT")
                                  if self.is_postgres else self.engine)
        # The connection each engine's last transaction used, for the next (most transactions
        # of a process come one after another; held.HeldConnection).
        self._held = {id(engine): HeldConnection(engine, ping_after_idle=ping_after_idle,
                                                 max_age=None if self.is_sqlite else RECYCLE)
                      for engine in (self.engine, self.read_engine, self.autocommit_engine)
                      if hold_connections}
        self._ended_hooks: list[EndedHook] = []
        # The store's shared keys read so far, by name (keys.Keys; a key never changes).
        self.shared_keys: dict[str, str] = {}
        # The webhook outbox (store/webhooks.py): where approval events are sent besides each
        # tool's own URLs, the page link's base, and who publishes a delivery after its commit
        # (broker/webhooks.install sets them from the settings).
        self.webhook_urls: tuple[str, ...] = ()
        self.public_url: str | None = None
        self.publish_webhooks: Callable[[Sequence[str]], None] | None = None

    def on_calls_ended(self, hook: EndedHook) -> None:
        """Run ``hook`` with the calls each committed write transaction ended, after its commit.

        Hooks run in the committing thread, in the order they were added, each guarded: one
        that raises is logged and the others still run. ``hook`` is added once, however often
        it is passed.
        """
        if hook not in self._ended_hooks:
            self._ended_hooks.append(hook)

    def ended_hooks(self) -> list[EndedHook]:
        """The hooks added with :meth:`on_calls_ended`, in order."""
        return list(self._ended_hooks)

    def _calls_ended(self, ended: Sequence[EndedCall]) -> None:
        for hook in self._ended_hooks:
            try:
                hook(ended)
            except Exception:
                log.exception("a hook on ended calls failed",
                              extra={"action": "ended_hook_error", "calls": len(ended)})

    def create_all(self) -> None:
        """Make the schema ready for this release (what every process does at start).

        An empty database is migrated to head; one at head is left as it is; anything else
        raises ``SchemaOutOfDateError`` naming ``dex-tasks db upgrade``. The migrations
        (``schema.py``) build the tables, never ``metadata.create_all``, so every database
        records its revision; concurrent first starts are serialised there.
        """
        from dex_tasks.store import schema  # schema.py needs only this class's read/write

        schema.prepare(self)

    def _fork_safe(self) -> AbstractContextManager[None]:
        return FORK_GUARD.transaction() if self.is_sqlite else nullcontext()

    def close(self) -> None:
        """Close the pooled connections (this process is done with the store)."""
        for held in self._held.values():
            held.close()
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    def _unavailable(self, err: SQLAlchemyError) -> StoreUnavailableError:
        """The error to raise for ``err``: :class:`StoreRefusedError` when waiting cannot
        fix it, :class:`StoreUnavailableError` otherwise."""
        cause = err.orig if isinstance(err, DBAPIError) else err
        refused = None if self.is_sqlite else refusal(str(cause), where=self.safe_url,
                                                      pooler=self.pooler)
        if refused is not None:
            return StoreRefusedError(refused)
        return StoreUnavailableError(
            f"the store at {self.safe_url} failed: {type(err).__name__}: {cause}")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except IntegrityError:
            raise
        except (DBAPIError, SQLAlchemyError) as err:
            raise self._unavailable(err) from err

    @property
    def safe_url(self) -> str:
        """The database URL without its password, for messages and logs."""
        return make_url(self.url).render_as_string(hide_password=True)

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction; commits on success, rolls back on error.

        The calls it ended go to the ``on_calls_ended`` hooks once it has committed (and
        nowhere if it rolled back).
        """
        with self._fork_safe(), self._errors(), self.committing(self.engine) as conn:
            yield conn

    @contextmanager
    def committing(self, engine: Engine, *, autocommit: bool = False,
                   on_driver: bool = False) -> Iterator[Connection]:
        """``engine.begin()`` that, once the transaction has committed, hands the calls it
        ended (:func:`note_ended`) to the ``on_calls_ended`` hooks. Every write transaction
        that may end a call opens through here. ``autocommit``: ``engine`` is in autocommit
        (each statement commits on its own), and the hooks run once the block is done.
        ``on_driver``: SQLite's writers' engine, with the transaction begun and committed on
        the DB-API connection (:meth:`_begun_on_driver`)."""
        ended: list[EndedCall] = []
        actions: list[Callable[[], None]] = []
        with (self._connect(engine) if autocommit
              else self._begun_on_driver(engine) if on_driver
              else self._begin(engine)) as conn:
            info = conn.info  # one lookup: SQLAlchemy finds it through the pool's record
            info[ENDED_CALLS] = ended
            info[AFTER_COMMIT] = actions
            try:
                yield conn
            except BaseException:
                # Best effort only: on a connection that was just lost, even reading
                # ``conn.info`` raises (PendingRollbackError), and that must not replace the
                # error a retry is decided on. A stale list left behind is replaced by the next
                # write transaction on that connection, and read ones never add to it.
                with suppress(Exception):
                    info.pop(ENDED_CALLS, None)
                    info.pop(AFTER_COMMIT, None)
                raise
            info.pop(ENDED_CALLS, None)
            info.pop(AFTER_COMMIT, None)
        if ended:
            self._calls_ended(ended)
        for action in actions:
            try:
                action()
            except Exception:
                log.exception("an after-commit action failed",
                              extra={"action": "after_commit_error"})

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction."""
        with self._fork_safe(), self._errors(), self._connect(self.read_engine) as conn:
            yield conn

    def _begin(self, engine: Engine) -> AbstractContextManager[Connection]:
        """``engine.begin()``, on the held connection when ``engine`` is one of the store's."""
        held = self._held.get(id(engine))
        return engine.begin() if held is None else held.begin()

    @contextmanager
    def _begun_on_driver(self, engine: Engine) -> Iterator[Connection]:
        """SQLite: a write transaction of ``engine`` (the writers' one, whose transactions
        take the write lock up front) whose ``BEGIN IMMEDIATE`` and ``COMMIT`` are sent on the
        DB-API connection, for a block that sends its statements there too (``driver.run``).

        Through ``engine.begin()`` SQLAlchemy's transaction objects, its events and the
        dialect's commit cost a worker child about as much CPU as SQLite's own ``BEGIN`` and
        ``COMMIT`` (issue 29). Nothing else changes: the connection is the held one, the lock
        is taken up front with the same busy timeout (``connections.sqlite_begin``), a
        statement the block sends through SQLAlchemy joins this transaction (and SQLAlchemy's
        commit then commits it), and a block that raises leaves the connection to the pool,
        whose reset rolls the transaction back."""
        with self._connect(engine) as conn:
            sqlite_begin(conn, immediate=True)
            info = conn.info
            info[DRIVER_TRANSACTION] = True
            try:
                yield conn
                if conn.in_transaction():
                    conn.commit()
                else:
                    run_text(conn, "COMMIT")
            finally:
                info.pop(DRIVER_TRANSACTION, None)

    def _connect(self, engine: Engine) -> AbstractContextManager[Connection]:
        """``engine.connect()``, on the held connection when ``engine`` is one of the
        store's."""
        held = self._held.get(id(engine))
        return engine.connect() if held is None else held.connect()

    def _retrying(self, op: Callable[[Connection, int], T], *, read: bool = False,
                  single: bool = False, prepared: bool = False, on_driver: bool = False) -> T:
        """Run ``op(conn, attempt)`` in a transaction of its own, and again on a new connection
        while the error is one a retry can cure (``connections.retryable``), for up to
        ``retry_seconds``; then :class:`StoreUnavailableError`.

        ``attempt`` counts from 1. Above 1, an earlier try may have committed before its
        connection was lost (during COMMIT, or before a one-statement write's reply): an
        ``op`` that must not write twice checks. ``single``: ``op`` runs on an autocommit
        connection (PostgreSQL; SQLite keeps its transaction), where each statement is its
        own transaction: for one-statement writes, and for reads of one statement, which a
        transaction would cost two more round trips (``BEGIN``, and the ``ROLLBACK`` of the
        connection's return to the pool) and no more consistency. Under
        ``bounded_statements`` (sweeps, lease renewals) ``op`` runs in a short transaction
        instead, which keeps the bounds' ``SET LOCAL`` (nothing is set on the session: a
        pooler would hand it to another client). ``prepared``: a read whose ``op`` sends only
        prepared statements on the DB-API connection (``driver.run``), which begin no
        transaction: on SQLite it runs on the writers' connection, whose page cache this
        process's own writes keep current (the readers' connection would read again from the
        file every page that the last write, on the other connection, changed).
        ``on_driver``: a write whose ``op`` sends its statements on the DB-API connection
        too; on SQLite its transaction is begun and committed there
        (:meth:`_begun_on_driver`).
        """
        autocommit = single and self.is_postgres and not statements_bounded()
        engine = (self.autocommit_engine if autocommit
                  else self.engine if read and prepared
                  else self.read_engine if read else self.engine)
        started = time.monotonic()
        deadline = started + self.retry_seconds
        pause = RETRY_FIRST_PAUSE
        attempt = 1
        while True:
            try:
                with self._fork_safe(), (self._connect(engine) if read else self.committing(
                        engine, autocommit=autocommit,
                        on_driver=on_driver and self.is_sqlite)) as conn:
                    return op(conn, attempt)
            except IntegrityError:
                raise
            except DBAPIError as err:
                failure = self._unavailable(err)
                if (isinstance(failure, StoreRefusedError)
                        or not retryable(err, sqlite=self.is_sqlite)
                        or time.monotonic() + pause > deadline):
                    raise failure from err
                log.warning("store connection lost or busy; trying again", extra={
                    "action": "store_retry", "attempt": attempt, "store": self.safe_url,
                    "retrying_for": f"{time.monotonic() - started:.1f}s",
                    "error": f"{type(err.orig).__name__}: {str(err.orig).strip()[:200]}"})
            except SQLAlchemyError as err:
                raise self._unavailable(err) from err
            time.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_PAUSE)
            attempt += 1

    # -- the store's clock ----------------------------------------------------------------------

    def store_time(self) -> float:
        """The store's clock now (``connections.store_now``): what leases are judged by."""
        return float(self._retrying(lambda conn, _: conn.execute(STORE_NOW).scalar_one(),
                                    read=True, single=True))

    def writable_at(self) -> float:
        """Take the store's write lock (on SQLite; a round trip on PostgreSQL) and return the
        store's time at that moment: a point after which every writer that was waiting for
        the lock, or for the server, can go on."""
        return float(self._retrying(lambda conn, _: conn.execute(STORE_NOW).scalar_one()))

    def reading(self, read: Callable[[Connection], T]) -> T:
        """``read(conn)`` in a read-only transaction, run again on a new connection when the
        connection is lost (a read is always safe to repeat), for up to ``retry_seconds``.
        ``read`` must return plain values, not result objects tied to the connection."""
        return self._retrying(lambda conn, _: read(conn), read=True)

    def writing(self, write: Callable[[Connection], T]) -> T:
        """``write(conn)`` in a write transaction, run again on a new connection when the
        connection is lost, for up to ``retry_seconds``: only for writes that are safe to run
        twice (an upsert), since a lost COMMIT may have committed the first try."""
        return self._retrying(lambda conn, _: write(conn))

    def _fetch(self, stmt: Any) -> list[dict[str, Any]]:
        """Every row of a read-only statement, as dicts; retried across a lost connection like
        the store's writes (a read is always safe to run again). For the reads an agent
        process makes between its calls, which must not fail on a connection the server has
        just closed while a new one would answer."""
        return self._retrying(lambda conn, _: [dict(r) for r in conn.execute(stmt).mappings()],
                              read=True, single=True)
