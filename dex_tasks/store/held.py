"""The connection a store keeps between its transactions (:class:`HeldConnection`)."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from sqlalchemy import Engine
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DisconnectionError

from dex_tasks.store.connections import INHERITED


class HeldConnection:
    """One pooled connection of ``engine`` kept checked out between the transactions of this
    process, for whichever transaction next finds it free.

    Checking a connection out of SQLAlchemy's pool and back in costs about as much as a short
    transaction itself: building the ``Connection``, the pool's locks and events, the reset
    on the way back (a ``ROLLBACK`` on SQLite, the isolation level set and reset around each
    autocommit statement on PostgreSQL): about 40 µs a transaction on SQLite and 70-100 µs
    on PostgreSQL on this project's machines. A worker child runs two such transactions per
    call and the producer two more, each after the last on one thread, so each takes the
    connection the last one left. A transaction that finds it taken (another thread has it)
    checks one out of the pool, as before, and returns it there.

    What the pool does on checkout is kept: a connection is held only between transactions,
    never with one open, so a fork never inherits a lock (``ForkGuard``); a child never uses
    what its parent held (checked by PID) and keeps it referenced, untouched, like the
    pool's (``INHERITED``); one that failed (lost, invalidated) goes back to the pool, which
    replaces it, and so does one whose execution options the block changed (an isolation
    level, read-only), which the pool resets. One whose server ended the session while it was
    held (its goodbye waits on the socket: one ``poll``, no round trip) is replaced before
    use. ``ping_after_idle``: one held that long unused is pinged first, and replaced if the
    server closed it silently (``server_engine``); ``max_age``: one that old goes back to
    the pool, which recycles it.
    """

    def __init__(self, engine: Engine, *, ping_after_idle: float | None = None,
                 max_age: float | None = None) -> None:
        self.engine = engine
        self.ping_after_idle = ping_after_idle
        self.max_age = max_age
        # At most one (connection, taken from the pool at, given back at), monotonic clock.
        self._held: list[tuple[Connection, float, float]] = []
        self._pid = os.getpid()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection for one transaction (or one read) of the ``with`` block; what the
        block leaves open is rolled back when it is held again."""
        conn, born = self._take()
        options = conn.get_execution_options()
        try:
            yield conn
        except BaseException:
            # Back to the pool, which resets or replaces it; the block's error is the one a
            # retry is decided on, never one from closing a connection that was lost.
            _discard(conn)
            raise
        if conn.get_execution_options() != options:
            # The block changed what the pool resets on return (an isolation level, a
            # read-only snapshot: session_views' REPEATABLE READ): it goes back to be reset.
            _discard(conn)
            return
        self._give_back(conn, born)

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction of the ``with`` block, as ``engine.begin()``."""
        with self.connect() as conn, conn.begin():
            yield conn

    def _take(self) -> tuple[Connection, float]:
        if self._pid != os.getpid():
            # Forked: what the parent held is the parent's (its SQLite handle, its socket).
            INHERITED.append(self._held)
            self._held, self._pid = [], os.getpid()
        try:
            conn, born, idle_from = self._held.pop()  # atomic: no two threads take one
        except IndexError:
            return self.engine.connect(), time.monotonic()
        now = time.monotonic()
        if self.max_age is not None and now - born >= self.max_age:
            _discard(conn)
            return self.engine.connect(), now
        if _hung_up(conn):
            # The server ended this session while it sat here (a restart, a failover, an
            # operator, an idle timeout): its goodbye is waiting on the socket. The pool may
            # hand over one that still works; a statement on this one would only fail.
            _discard(conn, invalidate=True)
            return self.engine.connect(), now
        if self.ping_after_idle is not None and now - idle_from >= self.ping_after_idle:
            try:
                dbapi = conn.connection.dbapi_connection
                if dbapi is None or not self.engine.dialect.do_ping(dbapi):
                    raise DisconnectionError("a held connection that sat idle was closed")
            except Exception:  # noqa: BLE001 - closed meanwhile: the pool opens another
                _discard(conn, invalidate=True)
                return self.engine.connect(), now
        return conn, born

    def _give_back(self, conn: Connection, born: float) -> None:
        if self._held or conn.closed or conn.invalidated or self._pid != os.getpid():
            _discard(conn)
            return
        try:
            if conn.in_transaction():
                conn.rollback()  # a read's transaction (SQLAlchemy begins one on first use)
        except Exception:  # noqa: BLE001 - a connection that cannot be reset goes to the pool
            _discard(conn)
            return
        self._held.append((conn, born, time.monotonic()))

    def close(self) -> None:
        """Return the held connection to the pool (before the engine is disposed)."""
        while self._pid == os.getpid() and self._held:
            _discard(self._held.pop()[0])


def _discard(conn: Connection, *, invalidate: bool = False) -> None:
    """Give ``conn`` back to the pool (``invalidate``: to be replaced), whatever state it is
    in: a connection that was lost may raise on the way."""
    with suppress(Exception):
        if invalidate:
            conn.invalidate()
        conn.close()


def _hung_up(conn: Connection) -> bool:
    """True if the server has spoken on an idle connection's socket, which an idle session
    hears almost only when the server ends it (a message, then EOF; a false alarm costs one
    pool checkout): one ``poll`` with no wait, no round trip. False for a connection without a
    socket (SQLite)."""
    dbapi = conn.connection.dbapi_connection
    fileno = getattr(dbapi, "fileno", None)
    if fileno is None:
        return False
    try:
        poller = select.poll()
        poller.register(fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return True  # no socket to ask: closed already
