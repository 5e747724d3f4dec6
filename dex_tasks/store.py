"""The SQL store: engine set-up, the one guarded transition function, and queries.

``transition`` is the only code that writes a call's status. It is a compare-and-set
(``UPDATE ... WHERE key = :key AND status IN (:allowed)``) whose row count says whether this
caller won, and it writes the event row in the same transaction; a move to a terminal status
also appends the call's tool message to the session's transcript there.

Every call a committed transaction ended is then handed to the store's ``on_calls_ended``
hooks, after the commit and never before: that is how waiters are woken and ended calls
counted (``notify.py``), with no Redis import here. A hook that fails is logged; the
transition it follows has committed and stays done.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Engine, bindparam, event, exists, func, insert, literal, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, SQLAlchemyError
from sqlalchemy.sql.elements import ClauseElement, ColumnElement
from sqlmodel import SQLModel, create_engine

from dex_tasks.errors import IllegalTransitionError, StoreUnavailableError
from dex_tasks.models import CallEventRow, CatalogRow, InterruptRow, MessageRow, ToolCallRow
from dex_tasks.states import ALLOWED_FROM, CallStatus, MessageRole

log = logging.getLogger("dex_tasks.store")

CALLS = ToolCallRow.__table__  # type: ignore[attr-defined]
EVENTS = CallEventRow.__table__  # type: ignore[attr-defined]
INTERRUPTS = InterruptRow.__table__  # type: ignore[attr-defined]
CATALOG = CatalogRow.__table__  # type: ignore[attr-defined]
MESSAGES = MessageRow.__table__  # type: ignore[attr-defined]


def readable_calls(rows: Iterable[Any]) -> list[ToolCallRow]:
    """The rows that make valid calls; each one that does not is logged and left out.

    A batch read by a sweep must not fail because of one row it cannot read (an id longer
    than its column, stored by an older release on SQLite, or a value no status or effect
    class has): every other call in the batch still needs recovering.
    """
    calls = []
    for row in rows:
        try:
            calls.append(ToolCallRow.model_validate(dict(row)))
        except ValidationError as err:
            log.error("unreadable call row skipped", extra={
                "action": "store_row_unreadable", "key": ascii(str(row.get("key", "?"))[:120]),
                "error": str(err).splitlines()[0]})
    return calls


def event_name(to: CallStatus) -> str:
    """The stable name of the event a move to ``to`` writes."""
    if to.terminal:
        return "tool_call_finished"
    return {
        CallStatus.AWAITING_APPROVAL: "tool_call_awaiting_approval",
        CallStatus.QUEUED: "tool_call_queued",
        CallStatus.RUNNING: "tool_call_started",
    }[to]


# Database connections a forked child inherited from its parent. The child never uses them
# (see _guard_fork) and never closes them either: closing would end the parent's PostgreSQL
# session (libpq sends Terminate on the shared socket) or disturb its SQLite locks. Kept
# referenced here so garbage collection does not close them.
INHERITED: list[Any] = []


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


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    # Pooled: opening a SQLite connection and setting its pragmas costs about a millisecond,
    # as much as the transaction itself. _guard_fork keeps pooled connections per process.
    engine = create_engine(
        url, pool_size=5, max_overflow=20,
        connect_args={"timeout": 30, "check_same_thread": False},
    )
    _guard_fork(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from pysqlite so BEGIN is ours to issue.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the lock up front: a deferred transaction that reads and then writes can
        # fail with SQLITE_BUSY at once instead of waiting on busy_timeout.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


_DELIVERY_LOCK_SPACE = 0x64657801  # the first key of dex-tasks' per-session message locks
_OPEN_STATUSES = [CallStatus.AWAITING_APPROVAL.value, CallStatus.QUEUED.value,
                  CallStatus.RUNNING.value]


def deliver_ready_messages(conn: Connection, now: float, session_id: str | None = None) -> int:
    """Mark delivered the queued user messages whose turn is over; returns how many.

    A message waits for every turn that had begun when it was sent (a turn with a call
    requested at or before the message), including calls those turns add later; turns begun
    after it do not hold it back. ``session_id=None`` looks at every session (the sweep).

    On PostgreSQL, two transactions that each end one of a turn's last two calls (or one ends
    the turn while another sends a message) would each not see the other's uncommitted change
    and leave the message queued. A per-session transaction lock taken before the check
    serialises them, and the check then runs with a fresh snapshot that sees the other's
    commit. SQLite writers are serialised anyway. Rows the sweep is delivering are skipped
    (``SKIP LOCKED``), so ending a call never waits on it.
    """
    if session_id is not None:
        lock_session_messages(conn, session_id)
    if session_id is None:
        result = conn.execute(_DELIVER_ALL, {"deliver_now": now})
    else:
        result = conn.execute(_DELIVER_SESSION, {"deliver_now": now, "deliver_session": session_id})
    return int(result.rowcount or 0)


def lock_session_messages(conn: Connection, session_id: str) -> None:
    """Serialise, until the end of ``conn``'s transaction, the writers of one session's
    messages that must see each other's commits (delivery, the one-report-per-call rule).

    A PostgreSQL advisory transaction lock on the session (re-entrant within a transaction);
    statements run after it get a snapshot that includes what the previous holder committed.
    SQLite needs nothing: its writers are serialised by ``BEGIN IMMEDIATE``.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(_DELIVERY_LOCK, {"lock_session": session_id})


def _delivery_statement(*, one_session: bool) -> Any:
    # Built once: constructing this statement costs milliseconds of Python, and a terminal
    # transition runs it every time. The compiled form is cached; the values are bound.
    m = MESSAGES.alias("m")
    c = CALLS.alias("c")
    t = CALLS.alias("t")
    turn_begun_before = exists().where(
        t.c.session_id == c.c.session_id, t.c.turn_id == c.c.turn_id,
        t.c.created_at <= m.c.created_at,
    ).correlate(c, m)
    open_call = exists().where(
        c.c.session_id == m.c.session_id, c.c.status.in_(_OPEN_STATUSES), turn_begun_before
    )
    ready = select(m.c.id).where(m.c.status == "queued", m.c.role == MessageRole.USER.value,
                                 ~open_call)
    if one_session:
        ready = ready.where(m.c.session_id == bindparam("deliver_session"))
    return (
        update(MESSAGES)
        .where(MESSAGES.c.id.in_(ready.with_for_update(skip_locked=True)),
               MESSAGES.c.status == "queued")
        .values(status="delivered", delivered_at=bindparam("deliver_now"))
    )


_DELIVER_SESSION = _delivery_statement(one_session=True)
_DELIVER_ALL = _delivery_statement(one_session=False)
_DELIVERY_LOCK = select(func.pg_advisory_xact_lock(
    literal(_DELIVERY_LOCK_SPACE), func.hashtext(bindparam("lock_session"))))


# Statements on the hot path, built once: building one with .values(...) costs about half a
# millisecond of Python per call, as much as SQLite takes to run it. Values are bound.
_INSERT_CALL = insert(CALLS)
_INSERT_INTERRUPT = insert(INTERRUPTS)
_INSERT_EVENT = insert(EVENTS)
_INSERT_MESSAGE = insert(MESSAGES)
_GET_CALL = select(CALLS).where(CALLS.c.key == bindparam("get_key"))

# What a transition's UPDATE returns: the event row needs these two; a terminal transition
# also builds its call's tool message from the rest (the values just written), so it needs
# no read of its own.
_RETURNING = (CALLS.c.session_id, CALLS.c.prev_status)
_RETURNING_TERMINAL = (*_RETURNING, CALLS.c.turn_id, CALLS.c.tool_call_id, CALLS.c.tool,
                       CALLS.c.arguments, CALLS.c.result, CALLS.c.error, CALLS.c.effect,
                       CALLS.c.created_at)


def _returning(to: CallStatus) -> tuple[Any, ...]:
    return _RETURNING_TERMINAL if to.terminal else _RETURNING


@functools.lru_cache(maxsize=256)
def _transition_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...],
) -> Any:
    """The guarded UPDATE of one transition shape, with every value a bound parameter."""
    return (
        update(CALLS)
        .where(CALLS.c.key == bindparam("t_key"),
               CALLS.c.status.in_(sorted(s.value for s in sources)),
               *(CALLS.c[k] == bindparam(f"m_{k}") for k in match))
        # SET evaluates right-hand sides against the old row, so prev_status keeps the status
        # we moved from, for the event row.
        .values(prev_status=CALLS.c.status, status=to.value,
                **{k: bindparam(f"v_{k}") for k in fields})
        .returning(*_returning(to))
    )


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


EndedHook = Callable[[Sequence[EndedCall]], None]

# Where a write transaction collects the calls it ends, until it has committed (conn.info).
_ENDED = "dex_ended_calls"


def note_ended(conn: Connection, key: str, to: CallStatus, row: Any, now: float) -> None:
    """Remember that this transaction ends call ``key`` (``row``: what its UPDATE returned),
    for the hooks that run once it has committed (see :meth:`Store.write`)."""
    ended = conn.info.get(_ENDED)
    if ended is not None:
        ended.append(EndedCall(key=key, session_id=row.session_id, tool=row.tool,
                               effect=row.effect, status=to, created_at=row.created_at,
                               finished_at=now))


class _ForkGuard:
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
            # Bounded: a thread already inside a transaction must not wait on a fork that
            # waits on it.
            self._cond.wait_for(lambda: not self._forking, timeout=self.FORK_WAIT_SECONDS)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
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


_FORK_GUARD = _ForkGuard()


class Store:
    """Access to the SQL store. Safe across fork: a child opens connections of its own."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.is_sqlite = database_url.startswith("sqlite")
        if self.is_sqlite:
            self.engine = _sqlite_engine(database_url, immediate=True)
            self.read_engine = _sqlite_engine(database_url, immediate=False)
        else:
            # No pool_pre_ping: it costs a round trip per transaction (three per call in a
            # worker). A connection the server dropped fails one statement instead, which
            # SQLAlchemy recognises as a disconnect and answers by discarding the whole pool;
            # the call it hit is finished by the sweeps (its lease or the republisher).
            self.engine = create_engine(
                database_url, pool_size=5, max_overflow=10, pool_recycle=1800
            )
            _guard_fork(self.engine)
            self.read_engine = self.engine
        self._ended_hooks: list[EndedHook] = []

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
        """Create the tables and indexes that do not exist yet."""
        with self._fork_safe(), self._errors():
            SQLModel.metadata.create_all(self.engine)

    def _fork_safe(self) -> AbstractContextManager[None]:
        return _FORK_GUARD.transaction() if self.is_sqlite else nullcontext()

    def close(self) -> None:
        """Close the pooled connections (this process is done with the store)."""
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except IntegrityError:
            raise
        except (DBAPIError, SQLAlchemyError) as err:
            cause = err.orig if isinstance(err, DBAPIError) else err
            raise StoreUnavailableError(
                f"the store at {self.safe_url} failed: {type(err).__name__}: {cause}"
            ) from err

    @property
    def safe_url(self) -> str:
        """The database URL without its password, for messages and logs."""
        from sqlalchemy.engine import make_url

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
    def committing(self, engine: Engine) -> Iterator[Connection]:
        """``engine.begin()`` that, once the transaction has committed, hands the calls it
        ended (:func:`note_ended`) to the ``on_calls_ended`` hooks. Every write transaction
        that may end a call opens through here."""
        ended: list[EndedCall] = []
        with engine.begin() as conn:
            conn.info[_ENDED] = ended
            try:
                yield conn
            finally:
                conn.info.pop(_ENDED, None)
        if ended:
            self._calls_ended(ended)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction."""
        with self._fork_safe(), self._errors(), self.read_engine.connect() as conn:
            yield conn

    # -- the one function that changes a call's status ------------------------------------------

    def transition(
        self,
        key: str,
        to: CallStatus,
        *,
        allowed: Iterable[CallStatus] | None = None,
        where: Sequence[ColumnElement[bool]] = (),
        match: Mapping[str, Any] | None = None,
        values: Mapping[str, Any] | None = None,
        detail: Mapping[str, Any] | None = None,
        now: float | None = None,
        conn: Connection | None = None,
    ) -> bool:
        """Move call ``key`` to ``to`` if its status is one of ``allowed``; True if this won.

        ``allowed`` defaults to every legal predecessor and must be a subset of them.
        ``match`` adds equality guards on columns (the owning worker, an attempt count) and
        ``where`` any other guard; ``values`` sets other columns in the same statement. The
        event row is written in the same transaction, and so is, when ``to`` is terminal, the
        call's tool message in the session's transcript. ``conn`` runs it inside a
        transaction of :meth:`write`, whose commit hands a call it ended to the hooks.
        """
        legal = ALLOWED_FROM[to]
        sources = frozenset(legal if allowed is None else allowed)
        if not sources or not sources <= legal:
            illegal = sorted(s.value for s in sources - legal) or ["(none)"]
            raise IllegalTransitionError(
                f"call {key!r}: cannot move to {to.value} from {', '.join(illegal)}"
            )
        now = time.time() if now is None else now
        fields: dict[str, Any] = {"updated_at": now, **(values or {})}
        if to.terminal:
            fields.setdefault("finished_at", now)
            fields.setdefault("lease_expires_at", None)
        match = dict(match or {})
        params: dict[str, Any] | None = None
        if not where and not any(isinstance(v, ClauseElement) for v in fields.values()):
            # The common shape (plain values, equality guards): a statement built once per
            # shape and bound here costs a fraction of building one per call.
            stmt = _transition_statement(to, sources, tuple(sorted(match)), tuple(sorted(fields)))
            params = {"t_key": key, **{f"m_{k}": v for k, v in match.items()},
                      **{f"v_{k}": v for k, v in fields.items()}}
        else:
            guards = [*where, *(CALLS.c[k] == v for k, v in match.items())]
            stmt = (
                update(CALLS)
                .where(CALLS.c.key == key, CALLS.c.status.in_([s.value for s in sources]),
                       *guards)
                .values(prev_status=CALLS.c.status, status=to.value, **fields)
                .returning(*_returning(to))
            )
        if conn is not None:
            return self._transition_in(conn, stmt, params, key, to, detail, now)
        with self.write() as tx:
            return self._transition_in(tx, stmt, params, key, to, detail, now)

    @staticmethod
    def _transition_in(
        conn: Connection,
        stmt: Any,
        params: dict[str, Any] | None,
        key: str,
        to: CallStatus,
        detail: Mapping[str, Any] | None,
        now: float,
    ) -> bool:
        row = (conn.execute(stmt, params) if params is not None else conn.execute(stmt)).first()
        if row is None:
            return False
        conn.execute(_INSERT_EVENT, {
            "session_id": row.session_id,
            "key": key,
            "event": event_name(to),
            "from_status": row.prev_status,
            "to_status": to.value,
            "detail": json.dumps(dict(detail), default=str) if detail else None,
            "created_at": now,
        })
        if to.terminal:
            note_ended(conn, key, to, row, now)
            # The call's tool message, in the transaction that makes it terminal: a call
            # that ends has its message, and the guarded UPDATE above matches once, so it
            # never gets two (the unique index on the key is the backstop).
            conn.execute(_INSERT_MESSAGE, {
                "session_id": row.session_id,
                "role": MessageRole.TOOL.value,
                "text": None,
                "status": None,
                "created_at": now,
                "delivered_at": None,
                "turn_id": row.turn_id,
                "tool_call_id": row.tool_call_id,
                "tool": row.tool,
                "key": key,
                "call_status": to.value,
                "tool_arguments": row.arguments,
                "tool_output": row.result if to is CallStatus.SUCCEEDED else row.error,
            })
            # A turn may have just ended: deliver its queued user messages in this same
            # transaction, so no code path that ends a call can forget them.
            deliver_ready_messages(conn, now, row.session_id)
        return True

    # -- calls ----------------------------------------------------------------------------------

    def insert_call(
        self, row: Mapping[str, Any], interrupt: Mapping[str, Any] | None = None
    ) -> bool:
        """Insert a new call (and its interrupt) with its first event; False if the key exists."""
        try:
            with self.write() as conn:
                conn.execute(_INSERT_CALL, dict(row))
                if interrupt is not None:
                    conn.execute(_INSERT_INTERRUPT, dict(interrupt))
                conn.execute(_INSERT_EVENT, {
                    "session_id": row["session_id"],
                    "key": row["key"],
                    "event": "tool_call_requested",
                    "from_status": None,
                    "to_status": row["status"],
                    "detail": None,
                    "created_at": row["created_at"],
                })
        except IntegrityError:
            return False
        return True

    def insert_calls(
        self,
        rows: Sequence[Mapping[str, Any]],
        interrupts: Sequence[Mapping[str, Any]] = (),
        *,
        then: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Insert several new calls (and their interrupts) with their first events in ONE
        transaction; False, with nothing written, if any of the keys exists already.

        ``then(conn)`` runs in the same transaction after the inserts (the client ends calls
        with invalid arguments there), so the whole batch commits or none of it does.
        """
        if not rows:
            return True
        try:
            with self.write() as conn:
                conn.execute(_INSERT_CALL, [dict(r) for r in rows])
                if interrupts:
                    conn.execute(_INSERT_INTERRUPT, [dict(i) for i in interrupts])
                conn.execute(_INSERT_EVENT, [{
                    "session_id": r["session_id"],
                    "key": r["key"],
                    "event": "tool_call_requested",
                    "from_status": None,
                    "to_status": r["status"],
                    "detail": None,
                    "created_at": r["created_at"],
                } for r in rows])
                if then is not None:
                    then(conn)
        except IntegrityError:
            return False
        return True

    def get_calls(self, keys: Sequence[str]) -> dict[str, ToolCallRow]:
        """The stored calls among ``keys`` (one read), by key; missing keys are left out."""
        if not keys:
            return {}
        with self.read() as conn:
            rows = conn.execute(select(CALLS).where(CALLS.c.key.in_(list(keys)))).mappings()
            return {r["key"]: ToolCallRow.model_validate(dict(r)) for r in rows}

    def get_call(self, key: str) -> ToolCallRow | None:
        """The stored call, or None."""
        with self.read() as conn:
            row = conn.execute(_GET_CALL, {"get_key": key}).mappings().first()
        return ToolCallRow.model_validate(dict(row)) if row else None

    def calls_for_session(self, session_id: str) -> list[ToolCallRow]:
        """The session's calls, oldest first."""
        with self.read() as conn:
            rows = conn.execute(
                select(CALLS)
                .where(CALLS.c.session_id == session_id)
                .order_by(CALLS.c.created_at, CALLS.c.key)
            ).mappings()
            return [ToolCallRow.model_validate(dict(r)) for r in rows]

    def mark_published(self, key: str, now: float | None = None, *,
                       republished: bool = False) -> None:
        """Record when a message for a queued call was last published (not a status change).

        ``republished`` counts a republish by the stranded-call sweep, which backs off on
        calls it has already republished.
        """
        values: dict[str, Any] = {"published_at": time.time() if now is None else now}
        if republished:
            values["republishes"] = CALLS.c.republishes + 1
        with self.write() as conn:
            conn.execute(
                update(CALLS)
                .where(CALLS.c.key == key, CALLS.c.status == CallStatus.QUEUED.value)
                .values(**values)
            )

    def renew_leases(self, worker_prefix: str, keys: Sequence[str], until: float) -> int:
        """Extend the leases of ``keys`` still running on this worker; returns rows touched."""
        if not keys:
            return 0
        with self.write() as conn:
            result = conn.execute(
                update(CALLS)
                .where(
                    CALLS.c.key.in_(list(keys)),
                    CALLS.c.status == CallStatus.RUNNING.value,
                    CALLS.c.worker.like(worker_prefix + "%"),
                )
                .values(lease_expires_at=until)
            )
            return int(result.rowcount or 0)

    def expired_leases(self, now: float, limit: int = 500) -> list[ToolCallRow]:
        """Running calls whose lease ran out: their worker is gone or stopped renewing."""
        with self.read() as conn:
            rows = conn.execute(
                select(CALLS)
                .where(
                    CALLS.c.status == CallStatus.RUNNING.value,
                    CALLS.c.lease_expires_at < now,
                )
                .limit(limit)
            ).mappings()
            return readable_calls(rows)

    def stranded_queued(self, published_before: float, limit: int = 500) -> list[ToolCallRow]:
        """Queued calls with no publish since ``published_before`` (never published included)."""
        with self.read() as conn:
            rows = conn.execute(
                select(CALLS)
                .where(
                    CALLS.c.status == CallStatus.QUEUED.value,
                    (CALLS.c.published_at < published_before) | CALLS.c.published_at.is_(None),
                )
                .order_by(CALLS.c.published_at)
                .limit(limit)
            ).mappings()
            return readable_calls(rows)

    def events(self, session_id: str, after: int = 0, limit: int = 1000) -> list[CallEventRow]:
        """The session's events with ``id > after``, in order."""
        with self.read() as conn:
            rows = conn.execute(
                select(EVENTS)
                .where(EVENTS.c.session_id == session_id, EVENTS.c.id > after)
                .order_by(EVENTS.c.id)
                .limit(limit)
            ).mappings()
            return [CallEventRow.model_validate(dict(r)) for r in rows]

    def events_for_call(self, key: str) -> list[CallEventRow]:
        """Every event of one call, in order."""
        with self.read() as conn:
            rows = conn.execute(
                select(EVENTS).where(EVENTS.c.key == key).order_by(EVENTS.c.id)
            ).mappings()
            return [CallEventRow.model_validate(dict(r)) for r in rows]

    # -- catalog --------------------------------------------------------------------------------

    def publish_catalog(self, entries: Iterable[Mapping[str, Any]]) -> int:
        """Upsert catalog entries (one per tool); returns how many were written."""
        count = 0
        with self.write() as conn:
            for entry in entries:
                done = conn.execute(
                    update(CATALOG).where(CATALOG.c.name == entry["name"]).values(**entry)
                ).rowcount
                if not done:
                    conn.execute(insert(CATALOG).values(**entry))
                count += 1
        return count

    def list_catalog(self) -> list[CatalogRow]:
        """Every published catalog entry, by name."""
        with self.read() as conn:
            rows = conn.execute(select(CATALOG).order_by(CATALOG.c.name)).mappings()
            return [CatalogRow.model_validate(dict(r)) for r in rows]

    def get_catalog(self, name: str) -> CatalogRow | None:
        """The published catalog entry of one tool."""
        with self.read() as conn:
            row = conn.execute(select(CATALOG).where(CATALOG.c.name == name)).mappings().first()
        return CatalogRow.model_validate(dict(row)) if row else None
