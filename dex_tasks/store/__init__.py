"""The SQL store: the one guarded transition function, its set-based twin, the claim, and
queries.

``transition`` (and ``transition_many`` for sweeps, and ``claim``, the transition to
``running``) is the only code that writes a call's status. It is a compare-and-set
(``UPDATE ... WHERE key = :key AND status IN (:allowed)``) whose row count says whether this
caller won, and it writes the event row in the same transaction; a move to a terminal status
also appends the call's tool message to the session's transcript there.

Transitions are safe to run again, so a transition that loses its connection is run again on a
new one, for up to ``retry_seconds``. The one ambiguous case is a connection lost during
COMMIT: the first try may have committed. The retry then finds the row already in the target
state with the values that very try wrote (its ``updated_at`` is the transition's own
timestamp), takes that as won, and writes no second event or tool message.

Every call a committed transaction ended is then handed to the store's ``on_calls_ended``
hooks, after the commit and never before: that is how waiters are woken and ended calls
counted (``notify.py``), with no Redis import here. A hook that fails is logged; the
transition it follows has committed and stays done.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlalchemy import (
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.sql.elements import ClauseElement, ColumnElement, UnaryExpression
from sqlalchemy.sql.operators import custom_op

from dex_tasks.errors import IllegalTransitionError, StoreUnavailableError
from dex_tasks.states import ALLOWED_FROM, CallStatus, MessageRole
from dex_tasks.store.connections import (
    FORK_GUARD,
    INHERITED,
    retryable,
    server_engine,
    sqlite_engine,
    store_now,
)
from dex_tasks.store.models import CallEventRow, CatalogRow, InterruptRow, MessageRow, ToolCallRow

__all__ = ["INHERITED", "Move", "Store", "deliver_ready_messages", "event_name", "readable_calls"]

log = logging.getLogger("dex_tasks.store")

T = TypeVar("T")
V = TypeVar("V")

CALLS = ToolCallRow.__table__  # type: ignore[attr-defined]
EVENTS = CallEventRow.__table__  # type: ignore[attr-defined]
INTERRUPTS = InterruptRow.__table__  # type: ignore[attr-defined]
CATALOG = CatalogRow.__table__  # type: ignore[attr-defined]
MESSAGES = MessageRow.__table__  # type: ignore[attr-defined]

# Retrying a transaction across a reconnect: the first pause, and the longest.
RETRY_FIRST_PAUSE = 0.05
RETRY_MAX_PAUSE = 0.5


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


_DELIVERY_LOCK_SPACE = 0x64657801  # the first key of dex-tasks' per-session message locks
_OPEN_STATUSES = [CallStatus.AWAITING_APPROVAL.value, CallStatus.QUEUED.value,
                  CallStatus.RUNNING.value]


def deliver_ready_messages(conn: Connection, now: float, session_id: str | None = None, *,
                           locked: bool = False) -> int:
    """Mark delivered the queued user messages whose turn is over; returns how many.

    A message waits for every turn that had begun when it was sent (a turn with a call
    requested at or before the message), including calls those turns add later; turns begun
    after it do not hold it back. ``session_id=None`` looks at every session (the sweep).

    On PostgreSQL, two transactions that each end one of a turn's last two calls (or one ends
    the turn while another sends a message) would each not see the other's uncommitted change
    and leave the message queued. A per-session transaction lock taken before the check
    serialises them, and the check then runs with a fresh snapshot that sees the other's
    commit. SQLite writers are serialised anyway. Rows the sweep is delivering are skipped
    (``SKIP LOCKED``), so ending a call never waits on it. ``locked`` says this transaction
    already holds the session's lock.
    """
    if session_id is not None and not locked:
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
# The same lock, taken inside a terminal transition's UPDATE (in its RETURNING, so only when
# the row moved): it saves a round trip per call. Statements after the UPDATE see every commit
# of the lock's previous holder.
_DELIVERY_LOCK_RETURNING = func.pg_advisory_xact_lock(
    literal(_DELIVERY_LOCK_SPACE), func.hashtext(CALLS.c.session_id)).label("delivery_lock")
# The same lock on several sessions at once, always in the same (sorted) order, so that two
# set-based transitions never wait on each other in a circle.
_DELIVERY_LOCK_MANY = text(
    "SELECT pg_advisory_xact_lock(:space, hashtext(s)) FROM "
    "(SELECT s FROM unnest(CAST(:sessions AS text[])) AS s ORDER BY s) AS sorted_sessions"
)
_SESSIONS_WITH_QUEUED = (
    select(MESSAGES.c.session_id).distinct()
    .where(MESSAGES.c.status == "queued",
           MESSAGES.c.session_id.in_(bindparam("queued_sessions", expanding=True)))
)


# Statements on the hot path, built once: building one with .values(...) costs about half a
# millisecond of Python per call, as much as SQLite takes to run it. Values are bound.
_INSERT_CALL = insert(CALLS)
_INSERT_INTERRUPT = insert(INTERRUPTS)
_INSERT_EVENT = insert(EVENTS)
# A terminal transition's event row, which also says whether the session has user messages
# waiting; most calls end with none, and then the delivery statement is not run at all.
_INSERT_EVENT_QUEUED = _INSERT_EVENT.returning(
    exists().where(MESSAGES.c.status == "queued",
                   MESSAGES.c.session_id == bindparam("queued_session")).label("queued"))
_INSERT_MESSAGE = insert(MESSAGES)
_GET_CALL = select(CALLS).where(CALLS.c.key == bindparam("get_key"))
_STORE_NOW = select(store_now())
# The claim, queued -> running, returns the whole row: a worker needs no read before it. The
# lease runs on the store's clock (``connections.store_now``), never on the worker's.
_CLAIM = (
    update(CALLS)
    .where(CALLS.c.key == bindparam("c_key"), CALLS.c.status == CallStatus.QUEUED.value)
    .values(prev_status=CALLS.c.status, status=CallStatus.RUNNING.value,
            attempts=CALLS.c.attempts + 1, worker=bindparam("c_worker"),
            lease_expires_at=store_now() + bindparam("c_lease"),
            updated_at=bindparam("c_now"))
    .returning(*CALLS.c)
)
# Calls per UPDATE of a set-based transition (its guards and values are bound per call).
_MANY_CHUNK = 200


# What a move's UPDATE returns: the event row needs these three; a terminal move also builds
# its call's tool message from the rest (the values just written), so it needs no read.
_RETURNING = (CALLS.c.key, CALLS.c.session_id, CALLS.c.prev_status)
_RETURNING_TERMINAL = (*_RETURNING, CALLS.c.turn_id, CALLS.c.tool_call_id, CALLS.c.tool,
                       CALLS.c.arguments, CALLS.c.result, CALLS.c.error, CALLS.c.effect,
                       CALLS.c.created_at)


def _returning(to: CallStatus) -> tuple[Any, ...]:
    """What the UPDATE of a move to ``to`` returns, for what ``Store._record`` writes."""
    return _RETURNING_TERMINAL if to.terminal else _RETURNING


def _returning_one(to: CallStatus, postgres: bool) -> tuple[Any, ...]:
    """:func:`_returning` for a single transition, which on PostgreSQL also takes a terminal
    move's delivery lock there (see ``_DELIVERY_LOCK_RETURNING``)."""
    columns = _returning(to)
    return (*columns, _DELIVERY_LOCK_RETURNING) if to.terminal and postgres else columns

@functools.lru_cache(maxsize=256)
def _transition_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...], postgres: bool,
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
        .returning(*_returning_one(to, postgres))
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
    for the hooks that run once it has committed (see :meth:`Store.committing`)."""
    ended = conn.info.get(_ENDED)
    if ended is not None:
        ended.append(EndedCall(key=key, session_id=row.session_id, tool=row.tool,
                               effect=row.effect, status=to, created_at=row.created_at,
                               finished_at=now))


def _requested_event(row: Mapping[str, Any],
                     requested: Mapping[str, Any] | None) -> dict[str, Any]:
    """The first event of a new call; its detail keeps the request's options."""
    return {"session_id": row["session_id"], "key": row["key"], "event": "tool_call_requested",
            "from_status": None, "to_status": row["status"],
            "detail": json.dumps({"request": dict(requested)}, sort_keys=True)
            if requested is not None else None,
            "created_at": row["created_at"]}


def _event_row(row: Any, to: CallStatus, detail: Mapping[str, Any] | None,
               now: float) -> dict[str, Any]:
    """The event row of one move: ``row`` is what its UPDATE returned."""
    return {"session_id": row.session_id, "key": row.key, "event": event_name(to),
            "from_status": row.prev_status, "to_status": to.value,
            "detail": json.dumps(dict(detail), default=str) if detail else None,
            "created_at": now}


def _tool_message(row: Any, to: CallStatus, now: float) -> dict[str, Any]:
    """The transcript's tool message of a call that just became terminal (``to``)."""
    return {"session_id": row.session_id, "role": MessageRole.TOOL.value, "text": None,
            "status": None, "created_at": now, "delivered_at": None, "turn_id": row.turn_id,
            "tool_call_id": row.tool_call_id, "tool": row.tool, "key": row.key,
            "call_status": to.value, "tool_arguments": row.arguments,
            "tool_output": row.result if to is CallStatus.SUCCEEDED else row.error}


def _bound(column: str, value: Any) -> Any:
    """``value`` as a typed bound parameter of ``column`` (NULL for None)."""
    return literal(value, CALLS.c[column].type) if value is not None else None


def _equals(column: str, value: Any) -> ColumnElement[bool]:
    guard: ColumnElement[bool] = (CALLS.c[column].is_(None) if value is None
                                  else CALLS.c[column] == _bound(column, value))
    return guard


# How a statement that finds its calls by key guards their status. Given ``key IN (...) AND
# status = ?``, SQLite (which keeps no statistics here) prefers a (status, ...) index and then
# reads every call in that status: a sweep rejecting 1,000 of 1M pending approvals took 16 s
# instead of 0.1 s. A unary "+" (SQLite's documented way to keep a term from choosing an index)
# leaves it the key's index. PostgreSQL plans from its statistics, and has no "+" for text.
_STATUS_BY_KEY = UnaryExpression(CALLS.c.status, operator=custom_op("+"),
                                 type_=CALLS.c.status.type)


def _status_by_key(sqlite: bool) -> ColumnElement[Any]:
    return _STATUS_BY_KEY if sqlite else CALLS.c.status


@dataclass(frozen=True)
class Move:
    """One call's part in a set-based transition (:meth:`Store.transition_many`).

    ``to`` is where it goes; ``match`` the equality guards that must still hold on its row
    (the owner, the attempt count, the lease it was seen with); ``values`` the columns written
    to it (plain values); ``detail`` the detail of its event row.
    """

    key: str
    to: CallStatus
    match: Mapping[str, Any] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)
    detail: Mapping[str, Any] | None = None


def _sources(what: str, to: CallStatus,
             allowed: Iterable[CallStatus] | None) -> frozenset[CallStatus]:
    """The statuses a move to ``to`` may leave: ``allowed`` (default: every legal one), which
    must be legal; :class:`IllegalTransitionError` naming ``what`` otherwise."""
    legal = ALLOWED_FROM[to]
    sources = frozenset(legal if allowed is None else allowed)
    if not sources or not sources <= legal:
        illegal = sorted(s.value for s in sources - legal) or ["(none)"]
        raise IllegalTransitionError(
            f"{what}: cannot move to {to.value} from {', '.join(illegal)}"
        )
    return sources



class Store:
    """Access to the SQL store. Safe across fork: a child opens connections of its own.

    ``retry_seconds`` bounds how long the store's own operations (transitions, the claim,
    lease renewals, single-call reads and inserts) keep trying across lost connections and a
    busy database. ``ping_after_idle`` tests a pooled server connection that sat idle that
    many seconds before using it; for processes that idle (see
    ``connections.server_engine``).
    """

    def __init__(self, database_url: str, *, retry_seconds: float = 5.0,
                 ping_after_idle: float | None = None) -> None:
        self.url = database_url
        self.retry_seconds = retry_seconds
        self.is_sqlite = database_url.startswith("sqlite")
        if self.is_sqlite:
            self.engine = sqlite_engine(database_url, immediate=True)
            self.read_engine = sqlite_engine(database_url, immediate=False)
        else:
            self.engine = server_engine(database_url, ping_after_idle=ping_after_idle)
            self.read_engine = self.engine
        self.is_postgres = self.engine.dialect.name == "postgresql"
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
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()

    def _unavailable(self, err: SQLAlchemyError) -> StoreUnavailableError:
        cause = err.orig if isinstance(err, DBAPIError) else err
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
    def committing(self, engine: Engine) -> Iterator[Connection]:
        """``engine.begin()`` that, once the transaction has committed, hands the calls it
        ended (:func:`note_ended`) to the ``on_calls_ended`` hooks. Every write transaction
        that may end a call opens through here."""
        ended: list[EndedCall] = []
        with engine.begin() as conn:
            conn.info[_ENDED] = ended
            try:
                yield conn
            except BaseException:
                # Best effort only: on a connection that was just lost, even reading
                # ``conn.info`` raises (PendingRollbackError), and that must not replace the
                # error a retry is decided on. A stale list left behind is replaced by the next
                # write transaction on that connection, and read ones never add to it.
                with suppress(Exception):
                    conn.info.pop(_ENDED, None)
                raise
            conn.info.pop(_ENDED, None)
        if ended:
            self._calls_ended(ended)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction."""
        with self._fork_safe(), self._errors(), self.read_engine.connect() as conn:
            yield conn

    def _retrying(self, op: Callable[[Connection, int], T], *, read: bool = False) -> T:
        """Run ``op(conn, attempt)`` in a transaction of its own, and again on a new connection
        while the error is one a retry can cure (``connections.retryable``), for up to
        ``retry_seconds``; then :class:`StoreUnavailableError`.

        ``attempt`` counts from 1. Above 1, an earlier try may have committed before its
        connection was lost (during COMMIT): an ``op`` that must not write twice checks.
        """
        engine = self.read_engine if read else self.engine
        deadline = time.monotonic() + self.retry_seconds
        pause = RETRY_FIRST_PAUSE
        attempt = 1
        while True:
            try:
                with self._fork_safe(), (engine.connect() if read
                                         else self.committing(engine)) as conn:
                    return op(conn, attempt)
            except IntegrityError:
                raise
            except DBAPIError as err:
                if (not retryable(err, sqlite=self.is_sqlite)
                        or time.monotonic() + pause > deadline):
                    raise self._unavailable(err) from err
                log.warning("store connection lost or busy; trying again", extra={
                    "action": "store_retry", "attempt": attempt,
                    "error": f"{type(err.orig).__name__}: {str(err.orig).strip()[:200]}"})
            except SQLAlchemyError as err:
                raise self._unavailable(err) from err
            time.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_PAUSE)
            attempt += 1

    # -- the store's clock ----------------------------------------------------------------------

    def store_time(self) -> float:
        """The store's clock now (``connections.store_now``): what leases are judged by."""
        return float(self._retrying(lambda conn, _: conn.execute(_STORE_NOW).scalar_one(),
                                    read=True))

    def writable_at(self) -> float:
        """Take the store's write lock (on SQLite; a round trip on PostgreSQL) and return the
        store's time at that moment: a point after which every writer that was waiting for
        the lock, or for the server, can go on."""
        return float(self._retrying(lambda conn, _: conn.execute(_STORE_NOW).scalar_one()))

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
        call's tool message in the session's transcript. Without ``conn`` the transition runs
        in a transaction of its own, retried across a lost connection (see the module's doc).
        """
        sources = _sources(f"call {key!r}", to, allowed)
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
            stmt = _transition_statement(to, sources, tuple(sorted(match)),
                                         tuple(sorted(fields)), self.is_postgres)
            params = {"t_key": key, **{f"m_{k}": v for k, v in match.items()},
                      **{f"v_{k}": v for k, v in fields.items()}}
        else:
            guards = [*where, *(CALLS.c[k] == v for k, v in match.items())]
            stmt = (
                update(CALLS)
                .where(CALLS.c.key == key, CALLS.c.status.in_([s.value for s in sources]),
                       *guards)
                .values(prev_status=CALLS.c.status, status=to.value, **fields)
                .returning(*_returning_one(to, self.is_postgres))
            )
        if conn is not None:
            return self._transition_in(conn, stmt, params, key, to, detail, now) is not None

        def attempt(tx: Connection, n: int) -> bool:
            if self._transition_in(tx, stmt, params, key, to, detail, now) is not None:
                return True
            # Nothing matched. After a lost connection that may be our own earlier try, which
            # committed: the row then holds exactly what this transition writes.
            return n > 1 and self._landed(tx, key, to, {**match, **fields}, now) is not None

        return self._retrying(attempt)

    def _transition_in(
        self,
        conn: Connection,
        stmt: Any,
        params: dict[str, Any] | None,
        key: str,
        to: CallStatus,
        detail: Mapping[str, Any] | None,
        now: float,
    ) -> Any | None:
        row = (conn.execute(stmt, params) if params is not None else conn.execute(stmt)).first()
        if row is None:
            return None
        # A terminal move on PostgreSQL took the session's delivery lock in its RETURNING.
        self._record(conn, to, [row], {key: detail}, now, locked=True)
        return row

    def _record(self, conn: Connection, to: CallStatus, moved: Sequence[Any],
                details: Mapping[str, Mapping[str, Any] | None], now: float, *,
                locked: bool) -> None:
        """What every move writes besides the status, in the mover's transaction.

        ``moved`` are the rows the UPDATE returned (:func:`_returning`), ``details`` each
        one's event detail by key.

        1. One event row per call that moved.
        2. On a move to a terminal status, each call's tool message in the session's
           transcript, built from the returned row: a call that ends has its message, and
           the guarded UPDATE matches once, so it never gets two (the unique index on the
           key is the backstop).
        3. On a move to a terminal status, a turn may have just ended: the queued user
           messages of the sessions touched are delivered here, so no code path that ends a
           call can forget them. Sessions with no message queued skip the delivery statement:
           the event's INSERT says whether any is (one call), or one query does (many).

        ``locked``: this transaction already holds the sessions' delivery locks (PostgreSQL).
        """
        events = [_event_row(row, to, details[row.key], now) for row in moved]
        if not events:
            return
        if not to.terminal:
            conn.execute(_INSERT_EVENT, events[0] if len(events) == 1 else events)
            return
        for row in moved:
            note_ended(conn, row.key, to, row, now)
        messages = [_tool_message(row, to, now) for row in moved]
        conn.execute(_INSERT_MESSAGE, messages[0] if len(messages) == 1 else messages)
        sessions: list[str] = sorted({e["session_id"] for e in events})
        if self.is_postgres and not locked:
            conn.execute(_DELIVERY_LOCK_MANY, {"space": _DELIVERY_LOCK_SPACE,
                                               "sessions": sessions})
        if len(events) == 1:
            queued = conn.execute(_INSERT_EVENT_QUEUED,
                                  {**events[0], "queued_session": sessions[0]}).scalar_one()
            waiting = sessions if queued else []
        else:
            conn.execute(_INSERT_EVENT, events)
            waiting = list(conn.execute(_SESSIONS_WITH_QUEUED,
                                        {"queued_sessions": sessions}).scalars())
        for session_id in waiting:
            deliver_ready_messages(conn, now, session_id, locked=True)

    @staticmethod
    def _landed(conn: Connection, key: str, to: CallStatus, written: Mapping[str, Any],
                now: float) -> Any | None:
        """The call's row if it is in ``to`` and holds every plain value of ``written``: what
        a try that committed before its connection was lost left behind. Its ``updated_at``
        is the transition's own timestamp, so another writer's move does not match.

        That try's connection died before its post-commit hooks ran, so a call it ended is
        announced (waiters woken, metrics counted) after this transaction instead."""
        guards = [CALLS.c.key == key, CALLS.c.status == to.value]
        guards += [_equals(column, value) for column, value in written.items()
                   if not isinstance(value, ClauseElement)]
        row = conn.execute(select(CALLS).where(*guards)).first()
        if row is not None:
            log.warning("a transition whose connection was lost had committed; taken as won",
                        extra={"action": "store_commit_recovered", "key": key,
                               "status": to.value})
            if to.terminal:
                note_ended(conn, key, to, row, now)
        return row

    def claim(self, key: str, owner: str, lease_seconds: float, vet: Callable[[Any], V], *,
              now: float | None = None) -> tuple[Any, V] | None:
        """queued -> running for ``owner``, in one statement that returns the whole row.

        ``None`` when the call is not queued (a duplicate delivery, a call that ended, or no
        such call). The row's ``attempts`` counts the attempt this claim starts, and its lease
        runs ``lease_seconds`` on the store's clock. ``vet(row)`` runs inside the transaction
        before the event is written: whatever it raises rolls the claim back (the call stays
        queued, untouched) and propagates. Returns the row and what ``vet`` returned. Retried
        across a lost connection like :meth:`transition`.
        """
        now = time.time() if now is None else now
        params = {"c_key": key, "c_worker": owner, "c_lease": lease_seconds, "c_now": now}

        def attempt(tx: Connection, n: int) -> tuple[Any, V] | None:
            row = tx.execute(_CLAIM, params).first()
            if row is None:
                landed = n > 1 and self._landed(tx, key, CallStatus.RUNNING,
                                                {"worker": owner, "updated_at": now}, now)
                return (landed, vet(landed)) if landed else None
            vetted = vet(row)
            self._record(tx, CallStatus.RUNNING, [row],
                         {key: {"attempt": row.attempts, "worker": owner}}, now, locked=False)
            return row, vetted

        return self._retrying(attempt)

    def transition_many(
        self,
        moves: Sequence[Move],
        *,
        allowed: Iterable[CallStatus],
        now: float | None = None,
        conn: Connection | None = None,
    ) -> set[str]:
        """The set-based twin of :meth:`transition`, for the sweeps: many calls in one
        transaction, one guarded UPDATE per kind of move (its target and the columns it
        guards and writes) instead of one transaction per call.

        The guards are those of :meth:`transition`: the status must be one of ``allowed`` (a
        subset of each target's legal sources) and each move's ``match`` must hold on its
        row. Each call that moved gets its event row. Returns the keys of the calls that
        moved; the others (moved by someone else meanwhile, a lease renewed) are untouched.
        """
        sources = frozenset(allowed)
        for target in {m.to for m in moves}:
            _sources(f"{len(moves)} calls", target, sources)
        if not moves:
            return set()
        now = time.time() if now is None else now
        kinds: dict[tuple[CallStatus, tuple[str, ...], tuple[str, ...]], list[Move]] = {}
        for m in moves:
            kinds.setdefault((m.to, tuple(sorted(m.match)), tuple(sorted(m.values))),
                             []).append(m)

        def run(tx: Connection, n: int) -> set[str]:
            moved: set[str] = set()
            for (to, guarded, written), group in kinds.items():
                for i in range(0, len(group), _MANY_CHUNK):
                    moved |= self._move_chunk(tx, to, sources, guarded, written,
                                              group[i:i + _MANY_CHUNK], now)
            if n > 1:
                moved |= self._landed_many(tx, [m for m in moves if m.key not in moved], now)
            return moved

        return run(conn, 1) if conn is not None else self._retrying(run)

    def _move_chunk(self, conn: Connection, to: CallStatus, sources: frozenset[CallStatus],
                    guarded: tuple[str, ...], written: tuple[str, ...], chunk: Sequence[Move],
                    now: float) -> set[str]:
        fields: dict[str, Any] = {"updated_at": now}
        if to.terminal:
            fields.update({k: v for k, v in (("finished_at", now), ("lease_expires_at", None))
                           if k not in written})
        # Each call's own values, picked by its key (one value if they are all the same);
        # each call's own guards, or-ed.
        for column in written:
            values = {m.key: m.values[column] for m in chunk}
            if len(set(map(repr, values.values()))) == 1:
                fields[column] = next(iter(values.values()))
            else:
                fields[column] = cast(case({k: _bound(column, v) for k, v in values.items()},
                                           value=CALLS.c.key), CALLS.c[column].type)
        guard = or_(*(and_(CALLS.c.key == m.key, *(_equals(c, m.match[c]) for c in guarded))
                      for m in chunk))
        rows = conn.execute(
            update(CALLS)
            .where(_status_by_key(self.is_sqlite).in_(sorted(s.value for s in sources)), guard)
            .values(prev_status=CALLS.c.status, status=to.value, **fields)
            .returning(*_returning(to))
        ).all()
        self._record(conn, to, rows, {m.key: m.detail for m in chunk}, now, locked=False)
        return {r.key for r in rows}

    def _landed_many(self, conn: Connection, moves: Sequence[Move], now: float) -> set[str]:
        """The moves a try that lost its connection had committed (see :meth:`_landed`); the
        calls they ended are announced after this transaction, as that try's could not be."""
        landed: set[str] = set()
        for to in {m.to for m in moves}:
            keys = [m.key for m in moves if m.to is to]
            for row in conn.execute(
                    select(CALLS).where(CALLS.c.key.in_(keys),
                                        _status_by_key(self.is_sqlite) == to.value,
                                        CALLS.c.updated_at == now)):
                landed.add(row.key)
                if to.terminal:
                    note_ended(conn, row.key, to, row, now)
        if landed:
            log.warning("a set-based transition whose connection was lost had committed",
                        extra={"action": "store_commit_recovered", "count": len(landed)})
        return landed


    # -- calls ----------------------------------------------------------------------------------

    def insert_call(
        self, row: Mapping[str, Any], interrupt: Mapping[str, Any] | None = None, *,
        requested: Mapping[str, Any] | None = None,
    ) -> bool:
        """Insert a new call (and its interrupt) with its first event; False if the key exists.

        ``requested``: the request's options, kept as that event's detail (a repeat of the
        request is compared with them, see :meth:`requested_options`). Retried across a lost
        connection; when a retry finds the key taken by the very row this call inserted (an
        earlier try committed), that is an insert, not an existing call.
        """
        tries = 0

        def attempt(conn: Connection, n: int) -> None:
            nonlocal tries
            tries = n
            conn.execute(_INSERT_CALL, dict(row))
            if interrupt is not None:
                conn.execute(_INSERT_INTERRUPT, dict(interrupt))
            conn.execute(_INSERT_EVENT, _requested_event(row, requested))

        try:
            self._retrying(attempt)
        except IntegrityError:
            if tries > 1:
                stored = self.get_call(row["key"])
                return stored is not None and (stored.created_at, stored.arguments) == (
                    row["created_at"], row["arguments"])
            return False
        return True

    def insert_calls(
        self,
        rows: Sequence[Mapping[str, Any]],
        interrupts: Sequence[Mapping[str, Any]] = (),
        *,
        requested: Mapping[str, Any] | None = None,
        then: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Insert several new calls (and their interrupts) with their first events in ONE
        transaction; False, with nothing written, if any of the keys exists already.

        ``then(conn)`` runs in the same transaction after the inserts (the client ends calls
        with invalid arguments there), so the whole batch commits or none of it does. Retried
        across a lost connection like :meth:`insert_call`: when a retry finds the first key
        taken by the very row this batch inserted, an earlier try committed the whole batch.
        """
        if not rows:
            return True
        tries = 0

        def attempt(conn: Connection, n: int) -> None:
            nonlocal tries
            tries = n
            conn.execute(_INSERT_CALL, [dict(r) for r in rows])
            if interrupts:
                conn.execute(_INSERT_INTERRUPT, [dict(i) for i in interrupts])
            conn.execute(_INSERT_EVENT, [_requested_event(r, requested) for r in rows])
            if then is not None:
                then(conn)

        try:
            self._retrying(attempt)
        except IntegrityError:
            if tries > 1:
                first = rows[0]
                stored = self.get_call(first["key"])
                return stored is not None and (stored.created_at, stored.arguments) == (
                    first["created_at"], first["arguments"])
            return False
        return True

    def reading(self, read: Callable[[Connection], T]) -> T:
        """``read(conn)`` in a read-only transaction, run again on a new connection when the
        connection is lost (a read is always safe to repeat), for up to ``retry_seconds``.
        ``read`` must return plain values, not result objects tied to the connection."""
        return self._retrying(lambda conn, _: read(conn), read=True)

    def _fetch(self, stmt: Any) -> list[dict[str, Any]]:
        """Every row of a read-only statement, as dicts; retried across a lost connection like
        the store's writes (a read is always safe to run again). For the reads an agent
        process makes between its calls, which must not fail on a connection the server has
        just closed while a new one would answer."""
        return self.reading(lambda conn: [dict(r) for r in conn.execute(stmt).mappings()])

    def requested_options(self, keys: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """The request options each call was recorded with (its first event's detail), by key;
        None for a call recorded before options were kept."""
        if not keys:
            return {}
        rows = self._fetch(
            select(EVENTS.c.key, EVENTS.c.detail)
            .where(EVENTS.c.key.in_(list(keys)), EVENTS.c.event == "tool_call_requested"))
        found: dict[str, dict[str, Any] | None] = {}
        for row in rows:
            loaded = json.loads(row["detail"]) if row["detail"] else None
            found[row["key"]] = loaded.get("request") if isinstance(loaded, dict) else None
        return found

    def get_calls(self, keys: Sequence[str]) -> dict[str, ToolCallRow]:
        """The stored calls among ``keys`` (one read), by key; missing keys are left out."""
        if not keys:
            return {}
        rows = self._fetch(select(CALLS).where(CALLS.c.key.in_(list(keys))))
        return {r["key"]: ToolCallRow.model_validate(r) for r in rows}

    def get_call(self, key: str) -> ToolCallRow | None:
        """The stored call, or None. Retried across a lost connection."""
        row = self._retrying(
            lambda conn, _: conn.execute(_GET_CALL, {"get_key": key}).mappings().first(),
            read=True)
        return ToolCallRow.model_validate(dict(row)) if row else None

    def calls_for_session(self, session_id: str) -> list[ToolCallRow]:
        """The session's calls, oldest first."""
        rows = self._fetch(select(CALLS).where(CALLS.c.session_id == session_id)
                           .order_by(CALLS.c.created_at, CALLS.c.key))
        return [ToolCallRow.model_validate(r) for r in rows]

    def mark_published(self, keys: str | Sequence[str], now: float | None = None, *,
                       republished: bool = False) -> None:
        """Record when a message for queued calls was last published (not a status change).

        ``republished`` counts a republish by the stranded-call sweep, which backs off on
        calls it has already republished.
        """
        keys = [keys] if isinstance(keys, str) else list(keys)
        if not keys:
            return
        values: dict[str, Any] = {"published_at": time.time() if now is None else now}
        if republished:
            values["republishes"] = CALLS.c.republishes + 1
        stmt = (update(CALLS)
                .where(CALLS.c.key.in_(keys),
                       _status_by_key(self.is_sqlite) == CallStatus.QUEUED.value)
                .values(**values))
        self._retrying(lambda conn, _: conn.execute(stmt))

    def renew_leases(self, worker_prefix: str, keys: Sequence[str], seconds: float) -> int:
        """Extend the leases of ``keys`` still running on this worker to ``seconds`` from now
        on the store's clock; returns rows touched.

        "Now" is when the statement runs, so a renewal that waited for a lock or a reconnect
        still grants a whole lease. Retried across a lost connection (running it twice only
        extends the leases again).
        """
        if not keys:
            return 0
        stmt = (
            update(CALLS)
            .where(
                CALLS.c.key.in_(list(keys)),
                _status_by_key(self.is_sqlite) == CallStatus.RUNNING.value,
                CALLS.c.worker.like(worker_prefix + "%"),
            )
            .values(lease_expires_at=store_now() + seconds)
        )
        return self._retrying(lambda conn, _: int(conn.execute(stmt).rowcount or 0))

    def expired_leases(self, now: float | None = None, limit: int = 500) -> list[ToolCallRow]:
        """Running calls whose lease ran out by ``now`` (default: the store's clock): their
        worker is gone or stopped renewing."""
        bound = store_now() if now is None else literal(now)
        stmt = (
            select(CALLS)
            .where(CALLS.c.status == CallStatus.RUNNING.value, CALLS.c.lease_expires_at < bound)
            .limit(limit)
        )
        return self._retrying(lambda conn, _: readable_calls(conn.execute(stmt).mappings()),
                              read=True)

    def stranded_queued(self, published_before: float, limit: int = 500) -> list[ToolCallRow]:
        """Queued calls with no publish since ``published_before``: the never published first,
        then the oldest publishes; at most ``limit``.

        Two range reads of the ``(status, published_at)`` index, not one with ``OR``: with
        ``published_at < ? OR published_at IS NULL`` both engines walked every queued call
        when none was stranded (a backlog of 1M queued calls cost each idle sweep 80-220 ms).
        """
        queued = CALLS.c.status == CallStatus.QUEUED.value
        never = select(CALLS).where(queued, CALLS.c.published_at.is_(None)).limit(limit)
        stale = (select(CALLS).where(queued, CALLS.c.published_at < published_before)
                 .order_by(CALLS.c.published_at).limit(limit))

        def read(conn: Connection, _: int) -> list[ToolCallRow]:
            rows = readable_calls(conn.execute(never).mappings())
            if len(rows) < limit:
                # (PostgreSQL reads each statement at its own snapshot: a call is listed once)
                seen = {row.key for row in rows}
                rows += [row for row in readable_calls(conn.execute(
                    stale.limit(limit - len(rows))).mappings()) if row.key not in seen]
            return rows

        return self._retrying(read, read=True)

    def events(self, session_id: str, after: int = 0, limit: int = 1000) -> list[CallEventRow]:
        """The session's events with ``id > after``, in order."""
        rows = self._fetch(select(EVENTS)
                           .where(EVENTS.c.session_id == session_id, EVENTS.c.id > after)
                           .order_by(EVENTS.c.id).limit(limit))
        return [CallEventRow.model_validate(r) for r in rows]

    def events_for_call(self, key: str) -> list[CallEventRow]:
        """Every event of one call, in order."""
        rows = self._fetch(select(EVENTS).where(EVENTS.c.key == key).order_by(EVENTS.c.id))
        return [CallEventRow.model_validate(r) for r in rows]

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
        return [CatalogRow.model_validate(r)
                for r in self._fetch(select(CATALOG).order_by(CATALOG.c.name))]

    def get_catalog(self, name: str) -> CatalogRow | None:
        """The published catalog entry of one tool."""
        rows = self._fetch(select(CATALOG).where(CATALOG.c.name == name))
        return CatalogRow.model_validate(rows[0]) if rows else None
