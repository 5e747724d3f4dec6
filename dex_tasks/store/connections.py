"""How the store connects: engines per dialect, fork safety, which errors a retry can cure, the
store's clock, and the lock that serialises schema changes.

``store.py`` holds what the store *does*; this module holds what it needs from the database
driver to do it safely in workers that fork, lose connections and run on machines whose clocks
disagree.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Float, bindparam, event, func, literal, select
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, InterfaceError
from sqlalchemy.exc import OperationalError as SAOperationalError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlmodel import create_engine

from dex_tasks.errors import StoreRefusedError
from dex_tasks.settings import DexSettings
from dex_tasks.store.driver import run_text

# Database connections a forked child inherited from its parent. The child never uses them
# (see _guard_fork) and never closes them either: closing would end the parent's PostgreSQL
# session (libpq sends Terminate on the shared socket) or disturb its SQLite locks. Kept
# referenced here so garbage collection does not close them.
INHERITED: list[Any] = []

# SQLite's wait for the write lock before it gives up with "database is locked" (seconds).
SQLITE_BUSY_SECONDS = 30

# psycopg prepares a statement on the server once a connection has run it this many times, so
# later runs send only the parameters (no parse and plan): the hot statements (claim, finish,
# renew) are the same few texts on every call. psycopg's default is 5. Never behind a
# transaction pooler (DEX_STORE_POOLER=transaction): a statement prepared in one transaction's
# server session is missing from the next one's, or is another client's of the same name.
PREPARE_THRESHOLD = 2

# The first key of the advisory lock that serialises schema changes (``create_all`` today, the
# migrations later): "dex" followed by 0.
SCHEMA_LOCK_KEY = 0x64657800


def _guard_fork(engine: Engine) -> None:
    """Make pooled connections per process: a child replaces what it inherited, untouched.

    The recipe of SQLAlchemy's "Using Connection Pools with Multiprocessing or os.fork()",
    with the inherited connection kept open instead of closed.
    """

    @event.listens_for(engine, "connect")
    def _remember_pid(_dbapi_conn: Any, record: Any) -> None:
        record.info["pid"] = os.getpid()

    @event.listens_for(engine, "checkout")
    def _check_pid(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if record.info.get("pid") != os.getpid():
            INHERITED.append(dbapi_conn)
            record.dbapi_connection = proxy.dbapi_connection = None
            raise DisconnectionError("connection inherited across fork; opening a new one")


def sqlite_engine(url: str, *, immediate: bool) -> Engine:
    """A pooled SQLite engine in WAL mode; ``immediate`` makes every transaction a writer's."""
    # Pooled: opening a SQLite connection and setting its pragmas costs about a millisecond,
    # as much as the transaction itself. _guard_fork keeps pooled connections per process.
    engine = create_engine(
        url, pool_size=5, max_overflow=20,
        connect_args={"timeout": SQLITE_BUSY_SECONDS, "check_same_thread": False},
    )
    _guard_fork(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from pysqlite so BEGIN is ours to issue.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_SECONDS * 1000}")
        _use_wal(cur)
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        sqlite_begin(conn, immediate=immediate)

    return engine


# Set in a connection's ``info`` while a transaction begun on its SQLite DB-API connection is
# open (``StoreBase``'s hot-path writes): SQLAlchemy's own begin then joins it.
DRIVER_TRANSACTION = "dex_driver_transaction"


def sqlite_begin(conn: Connection, *, immediate: bool) -> None:
    """Begin a transaction on SQLite's DB-API connection under ``conn`` (what SQLAlchemy's
    ``begin`` runs on the store's SQLite engines, and ``StoreBase``'s transactions begun on the
    driver). Nothing inside a transaction begun on the driver (:data:`DRIVER_TRANSACTION`):
    a statement sent through SQLAlchemy there joins it."""
    info = conn.info
    if info.get(DRIVER_TRANSACTION):
        return
    # A bounded transaction (a sweep, a lease renewal: see bounded_statements) waits less
    # for the write lock than the others; the pragma runs only when the bound changes.
    bounds = _BOUNDS.get()
    busy_ms = int(1000 * (bounds.lock if bounds else SQLITE_BUSY_SECONDS))
    # (On the DB-API connection: SQLAlchemy's execute costs more than the BEGIN itself.)
    if info.get("dex_busy_ms") != busy_ms:
        run_text(conn, f"PRAGMA busy_timeout={busy_ms}")
        info["dex_busy_ms"] = busy_ms
    # Writers take the lock up front: a deferred transaction that reads and then writes can
    # fail with SQLITE_BUSY at once instead of waiting on busy_timeout.
    run_text(conn, "BEGIN IMMEDIATE" if immediate else "BEGIN")


def _use_wal(cur: Any) -> None:
    """Put the database in WAL mode, waiting (bounded) while another connection converts it.

    The mode is kept in the file, so only the first connection to a new database converts it.
    That needs the write lock, and SQLite does not wait for it here: when another process
    holds it (converting the same new file, as processes that start at once do), the pragma
    fails at once with "database is locked" whatever the busy timeout, and a worker, beat or
    the API then failed to start. A connection that finds WAL already on writes nothing.
    """
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    pause = 0.005
    while True:
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err).lower() or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


@dataclass(frozen=True)
class NetworkBounds:
    """How long a store connection may hang on a network that went silent (seconds).

    A host cut off by a partition sends no FIN and no RST: without these, a client waits in
    TCP retransmission for about 15 minutes, and the server keeps a dead client's session,
    with its row and advisory locks, until its own keepalives notice (about 2 hours by
    default). Every other worker waiting on those locks waited with it (issue 19, P1).

    * ``keepalive_*``: TCP keepalives on the client's socket, so an idle connection to a
      vanished server is found dead after ``idle + interval * count``;
    * ``tcp_user_timeout``: data sent and not acknowledged for this long ends the connection
      (a statement or COMMIT sent into a partition fails instead of hanging);
    * ``connect_timeout``: a connect whose SYN goes unanswered gives up after this long;
    * ``idle_in_transaction``: the server ends a session that sits inside a transaction, not
      running a statement, for this long, which frees the locks of a client that vanished
      mid-transaction. Set per session from the client (``options=-c ...``), so it holds
      without any server configuration, and so are the server's own keepalives and user
      timeout toward the client (PostgreSQL 12+). Not behind a transaction pooler, which
      refuses (or drops) startup options and whose server sessions are not the client's:
      there the pooler's own ``idle_transaction_timeout`` and keepalives, or the role's
      defaults (``ALTER ROLE ... SET``), do this (docs/deploying.md).

    dex-tasks never holds a transaction open across anything but its own statements (no
    Redis call, no tool code runs inside one), so a live client never comes near the idle
    bound.
    """

    keepalive_idle: int = 5
    keepalive_interval: int = 2
    keepalive_count: int = 3
    tcp_user_timeout: float = 10.0
    connect_timeout: int = 10
    idle_in_transaction: float = 10.0

    @classmethod
    def from_settings(cls, settings: DexSettings) -> NetworkBounds:
        """The bounds ``settings`` (``DEX_STORE_*``) give."""
        return cls(keepalive_idle=settings.store_keepalive_idle_seconds,
                   keepalive_interval=settings.store_keepalive_interval_seconds,
                   keepalive_count=settings.store_keepalive_count,
                   tcp_user_timeout=settings.store_tcp_user_timeout_seconds,
                   connect_timeout=settings.store_connect_timeout_seconds,
                   idle_in_transaction=settings.store_idle_in_transaction_seconds)

    def libpq_args(self, url: str, *, pooler: bool = False) -> dict[str, Any]:
        """libpq connection parameters for these bounds (``options`` merged with the URL's:
        a ``-c`` the URL gives comes last, so it wins). ``pooler``: a transaction pooler is
        in front, so only the client's own socket options (no ``options``: the URL's, if it
        gives any, still go as they are)."""
        user_timeout_ms = int(self.tcp_user_timeout * 1000)
        sockets = {"keepalives": 1, "keepalives_idle": self.keepalive_idle,
                   "keepalives_interval": self.keepalive_interval,
                   "keepalives_count": self.keepalive_count,
                   "tcp_user_timeout": user_timeout_ms,
                   "connect_timeout": self.connect_timeout}
        if pooler:
            return sockets
        server = {
            "idle_in_transaction_session_timeout": int(self.idle_in_transaction * 1000),
            "tcp_keepalives_idle": self.keepalive_idle,
            "tcp_keepalives_interval": self.keepalive_interval,
            "tcp_keepalives_count": self.keepalive_count,
            "tcp_user_timeout": user_timeout_ms,
        }
        options = " ".join(f"-c {name}={value}" for name, value in server.items())
        given = make_url(url).query.get("options")
        if given:
            options = f"{options} {given if isinstance(given, str) else ' '.join(given)}"
        return {**sockets, "options": options}


@dataclass(frozen=True)
class StatementBounds:
    """The longest a statement may run, and wait for a lock, in a bounded transaction."""

    statement: float
    lock: float


_BOUNDS: ContextVar[StatementBounds | None] = ContextVar("dex_statement_bounds", default=None)
_SET_BOUNDS = select(
    func.set_config("statement_timeout", bindparam("bound_statement"), True),
    func.set_config("lock_timeout", bindparam("bound_lock"), True))


@contextmanager
def bounded_statements(statement: float, lock: float) -> Iterator[None]:
    """Bound every transaction this thread opens in the ``with`` block.

    PostgreSQL: ``SET LOCAL statement_timeout`` and ``lock_timeout`` at the start of each.
    SQLite: a busy timeout of ``lock`` seconds. For the sweeps and the lease renewals: they
    must fail fast and try again, never queue for minutes behind a lock that a vanished
    client's session holds (the retry in ``StoreBase._retrying`` counts a lock timeout as a
    busy database).
    """
    token = _BOUNDS.set(StatementBounds(statement, lock))
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def statements_bounded() -> bool:
    """True inside :func:`bounded_statements`: what this thread runs now must run inside a
    transaction (the store then runs even a one-statement write in one, not in autocommit),
    since the bounds are a ``SET LOCAL`` that only a transaction keeps."""
    return _BOUNDS.get() is not None


RECYCLE = 1800
"""Seconds after which a server connection is replaced by a new one when next used (the
pool's ``pool_recycle``, and the held connection's age limit): a failover that moved the
server's address is followed within this much even by a connection that never failed."""


def server_engine(url: str, *, ping_after_idle: float | None,
                  network: NetworkBounds | None = None, pooler: bool = False) -> Engine:
    """A pooled engine for a database server (PostgreSQL).

    ``ping_after_idle`` (seconds): a pooled connection that sat idle at least that long is
    tested with a round trip before use, and replaced if the server (a proxy, an idle timeout,
    an operator) closed it meanwhile: for agent processes and the API, which idle between
    bursts and would otherwise see their first statement after a pause fail. Under load the
    pool hands out connections used moments ago, which are not pinged, so the ping costs
    nothing there (``pool_pre_ping`` would cost a round trip on every transaction). ``None``
    for workers: they retry their statements across a reconnect instead (``Store``).

    ``network``: how long a connection may hang on a silent network (:class:`NetworkBounds`;
    default: the bounds ``DEX_STORE_*`` give).

    ``pooler``: a transaction pooler (PgBouncer, ``pool_mode = transaction``) is in front
    (``DEX_STORE_POOLER=transaction``): each transaction may run on another server session,
    shared with other clients, so nothing may live in a session. No startup ``options``, no
    statements prepared on the server, and no ``SET`` but ``SET LOCAL`` (the bounds below;
    the store's advisory locks are all transaction-scoped). Without it, the first
    connection checks that the server took the startup options, which a pooler configured
    to ignore them (``ignore_startup_parameters = options``) silently drops: the store then
    refuses to go on, naming the setting (:class:`StoreRefusedError`), rather than fail
    later on a prepared statement another session does not have.
    """
    connect_args: dict[str, Any] = {}
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        bounds = network or NetworkBounds.from_settings(DexSettings())
        connect_args.update(bounds.libpq_args(url, pooler=pooler))
    if parsed.get_driver_name() == "psycopg":
        connect_args["prepare_threshold"] = None if pooler else PREPARE_THRESHOLD
    engine = create_engine(url, pool_size=5, max_overflow=10, pool_recycle=RECYCLE,
                           connect_args=connect_args)
    _guard_fork(engine)
    if parsed.get_backend_name() == "postgresql" and not pooler:
        _check_options_taken(engine, parsed.render_as_string(hide_password=True))

    @event.listens_for(engine, "begin")
    def _bound(conn: Connection) -> None:
        bounds = _BOUNDS.get()
        if bounds is None or conn.dialect.name != "postgresql":
            return
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            # A statement in autocommit has no transaction for a SET LOCAL to last through
            # (it would end before the statement ran), and a SET on the session would outlive
            # it (and behind a pooler, land on another client's session). The store runs
            # bounded work in transactions (see statements_bounded); nothing to bound here.
            return
        # set_config(..., true) is SET LOCAL: it ends with the transaction. One statement
        # with bound values, so psycopg can prepare it like the others.
        conn.execute(_SET_BOUNDS, {"bound_statement": f"{int(bounds.statement * 1000)}ms",
                                   "bound_lock": f"{int(bounds.lock * 1000)}ms"})

    @event.listens_for(engine, "handle_error")
    def _read_only_is_a_lost_server(context: Any) -> None:
        # A server that is read-only now (a primary demoted during a failover, a standby a
        # pooler or DNS still points at) refuses writes with 25006; the new primary is
        # reached on a new connection. Taken as a lost connection, it is retried as one (the
        # pool drops its connections to that server), never reported as the statement's
        # fault.
        if getattr(context.original_exception, "sqlstate", None) == READ_ONLY_SQLSTATE:
            context.is_disconnect = True

    if ping_after_idle is not None:
        _ping_after_idle(engine, ping_after_idle)
    return engine


# read_only_sql_transaction: a write sent to a server that only reads.
READ_ONLY_SQLSTATE = "25006"

# Where a setting the client sent in its startup options says so (pg_settings.source).
_OPTIONS_TAKEN = ("SELECT source FROM pg_settings "
                  "WHERE name = 'idle_in_transaction_session_timeout'")


def _check_options_taken(engine: Engine, where: str) -> None:
    """On the engine's first connection, make sure the server took the startup options (see
    :func:`server_engine`): one round trip per engine, none after."""
    checked = threading.Event()

    @event.listens_for(engine, "connect")
    def _options_taken(dbapi_conn: Any, _record: Any) -> None:
        if checked.is_set():
            return
        cur = dbapi_conn.cursor()
        try:
            cur.execute(_OPTIONS_TAKEN)
            row = cur.fetchone()
        finally:
            cur.close()
            dbapi_conn.rollback()
        if row is not None and row[0] != "client":
            raise StoreRefusedError(
                f"the store at {where} ignored the startup options dex-tasks sent "
                f"(idle_in_transaction_session_timeout came from {row[0]!r}, not the "
                "client): a connection pooler is in front of the server (PgBouncer with "
                "ignore_startup_parameters = options?): set DEX_STORE_POOLER=transaction "
                "(see docs/deploying.md, \"Behind a connection pooler\")")
        checked.set()


def _ping_after_idle(engine: Engine, seconds: float) -> None:
    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_from"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        idle_from = record.info.get("idle_from")
        if idle_from is None or time.monotonic() - idle_from < seconds:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as err:
            # The pool discards this connection and opens a new one.
            raise DisconnectionError("a pooled connection that sat idle was closed") from err


def retryable(err: DBAPIError, *, sqlite: bool) -> bool:
    """True when running the same transaction again may succeed: the connection was lost or
    could not be made, the server shut the session down or is read-only (a failover under
    way: see ``server_engine``), or the database was busy (a deadlock, a serialisation
    failure, SQLite's lock). False for errors in the statement or the data (a missing table,
    a constraint), which would fail again the same way, and for a server that refused us
    (``refusals.refusal``, which the store checks first)."""
    if err.connection_invalidated:
        return True
    if isinstance(err, IntegrityError):
        return False
    if sqlite:
        text = str(err.orig).lower()
        return isinstance(err, SAOperationalError) and ("locked" in text or "busy" in text)
    return isinstance(err, SAOperationalError | InterfaceError)


# -- the store's clock --------------------------------------------------------------------------


class store_now(FunctionElement[float]):  # lower case: it reads as the SQL function it is
    """The store's current time, as UTC epoch seconds, evaluated by the database.

    Leases are written and judged with it, so workers whose clocks disagree never disagree
    about a lease. PostgreSQL: the server's ``clock_timestamp()`` (the time at which the
    statement runs, not the start of its transaction). SQLite: ``julianday('now')``, the clock
    of the machine; every process that writes a SQLite file runs on that one machine (SQLite
    over a network file system is unsupported), so they all share that clock.
    """

    type = Float()
    name = "dex_store_now"
    inherit_cache = True


@compiles(store_now, "postgresql")
def _store_now_postgresql(_element: store_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    return "EXTRACT(EPOCH FROM clock_timestamp())::float8"


@compiles(store_now, "sqlite")
def _store_now_sqlite(_element: store_now, _compiler: SQLCompiler, **_kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


# -- serialising schema changes -----------------------------------------------------------------


def lock_schema(conn: Connection) -> None:
    """Hold, until ``conn``'s transaction ends, the lock every schema change takes first.

    Two processes starting at once on a fresh PostgreSQL database would otherwise both find a
    table missing and both create it; the second fails on the catalog's unique index. With the
    lock the second waits, then finds the tables there. SQLite needs nothing: a writer's
    ``BEGIN IMMEDIATE`` already holds the database's one write lock.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(literal(SCHEMA_LOCK_KEY))))


class ForkGuard:
    """Keeps ``os.fork()`` from happening while another thread has a SQLite transaction open.

    SQLite keeps its file-lock bookkeeping per process, in memory. A child forked while a
    thread of its parent holds a lock inherits the bookkeeping but not the OS lock behind it,
    and from then on every write the child tries fails with "database is locked". A worker's
    main process renews leases from a thread while billiard forks replacement children, so
    without this a child forked at the wrong moment failed every call it took. Forks wait
    (bounded) until no transaction is open; transactions wait while a fork is under way.
    """

    FORK_WAIT_SECONDS = 10.0

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._before_fork,
                                after_in_parent=self._after_in_parent,
                                after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._forking = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Mark a SQLite transaction as open in this process for the ``with`` block."""
        with self._cond:
            if self._forking:
                # Bounded: a thread already inside a transaction must not wait on a fork that
                # waits on it.
                self._cond.wait_for(lambda: not self._forking, timeout=self.FORK_WAIT_SECONDS)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._forking:  # only a fork waits for transactions to close
                    self._cond.notify_all()

    def _before_fork(self) -> None:
        self._cond.acquire()
        self._forking = True
        # Bounded, so a fork from inside a transaction (which would wait on itself) goes on.
        self._cond.wait_for(lambda: self._active == 0, timeout=self.FORK_WAIT_SECONDS)

    def _after_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()


FORK_GUARD = ForkGuard()
