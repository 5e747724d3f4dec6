"""The one guarded function that changes a call's status, and its set-based twin.

``transition`` (and ``transition_many`` for the sweeps, and ``claim`` in ``leases.py``, the
move to ``running``) is the only code that writes a call's status. It is a compare-and-set
(``UPDATE ... WHERE key = :key AND status IN (:allowed)``) whose row count says whether this
caller won, and it writes the event row in the same transaction (``_record``); a move to a
terminal status also appends the call's tool message to the session's transcript there and
delivers the user messages the end of its turn releases.

On PostgreSQL a transition that runs on its own (no ``conn`` given), the claim included, is ONE
statement in autocommit (:func:`single_statement`): the guarded UPDATE with its event row and
tool message as data-modifying CTEs, one round trip and one commit. SQLite keeps the
transaction form, and so do the set-based twin and moves made in a caller's transaction.

Transitions are safe to run again, so a transition that loses its connection is run again on a
new one, for up to ``retry_seconds``. The one ambiguous case is a connection lost during
COMMIT, or before a one-statement move's reply: the first try may have committed. The retry
then finds the row already in the target state with the values that very try wrote (its
``updated_at`` is the transition's own timestamp), takes that as won, and writes no second
event or tool message.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ClauseElement, ColumnElement

from dex_tasks.errors import DexError, IllegalTransitionError
from dex_tasks.states import ALLOWED_FROM, CallStatus, MessageRole
from dex_tasks.store import driver
from dex_tasks.store.base import StoreBase, note_ended
from dex_tasks.store.connections import store_now
from dex_tasks.store.delivery import (
    DELIVERY_LOCK_MANY,
    DELIVERY_LOCK_RETURNING,
    DELIVERY_LOCK_SPACE,
    SESSIONS_WITH_QUEUED,
    deliver_ready_messages,
)
from dex_tasks.store.sqljson import JsonText, jsonb_text
from dex_tasks.store.tables import (
    CALLS,
    EVENTS,
    INSERT_EVENT,
    INSERT_EVENT_PAIR_QUEUED,
    INSERT_EVENT_QUEUED,
    INSERT_MESSAGE,
    MESSAGES,
    bound,
    equals,
    event_name,
    status_by_key,
)

log = logging.getLogger("dex_tasks.store")

# Calls per UPDATE of a set-based transition (its guards and values are bound per call).
_MANY_CHUNK = 200



# What a move's UPDATE returns: the event row needs these three; a terminal move also builds
# its call's tool message from the rest (the values just written), so it needs no read.
_RETURNING = (CALLS.c.key, CALLS.c.session_id, CALLS.c.prev_status)
# A terminal move returns the whole ended row: its waiters are handed it with the notification
# that wakes them (``EndedCall.record``), and need no read of the store.
_RETURNING_TERMINAL = tuple(CALLS.c)


def _returning(to: CallStatus) -> tuple[Any, ...]:
    """What the UPDATE of a move to ``to`` returns, for what ``Store._record`` writes."""
    return _RETURNING_TERMINAL if to.terminal else _RETURNING


def _returning_one(to: CallStatus, postgres: bool) -> tuple[Any, ...]:
    """:func:`_returning` for a single transition, which on PostgreSQL also takes a terminal
    move's delivery lock there (see ``DELIVERY_LOCK_RETURNING``)."""
    columns = _returning(to)
    return (*columns, DELIVERY_LOCK_RETURNING) if to.terminal and postgres else columns

# What a claim also guards, besides the call being queued: it has not expired in the queue by
# the claimer's ``:c_now`` (a call expires by the clock of the worker that finds it expired, as
# before a claim existed), and it has an attempt left. In the claim's own WHERE, so a call that
# fails them is never claimed, and nothing has to be undone: the claim returns no row, and
# the worker reads the call to end it "did not run" or as its attempts ran out.
CLAIMABLE = (
    or_(CALLS.c.expires_at.is_(None), CALLS.c.expires_at >= bindparam("c_now")),
    CALLS.c.attempts < CALLS.c.max_attempts,
)


def _guarded_update(to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
                    fields: tuple[str, ...], *, claim: bool = False,
                    json_as_text: bool = False) -> Any:
    """The guarded UPDATE of one transition shape, with every value a bound parameter.

    ``claim``: the move to ``running`` is guarded by :data:`CLAIMABLE` as well, counts the
    attempt and sets the lease on the store's clock (``connections.store_now``) from
    ``:c_lease`` seconds. ``json_as_text`` (PostgreSQL): the values of JSON columns are bound
    as text and cast to jsonb by the server (``sqljson.jsonb_text``)."""
    extra: dict[str, Any] = ({"attempts": CALLS.c.attempts + 1,
                              "lease_expires_at": store_now() + bindparam("c_lease")}
                             if claim else {})
    return (
        update(CALLS)
        # The sources as one bound value each, not an IN list expanded per execution, so the
        # statement compiles once for the driver (``store.driver``).
        .where(CALLS.c.key == bindparam("t_key"),
               CALLS.c.status.in_([literal(s.value, CALLS.c.status.type)
                                   for s in sorted(sources)]),
               *(CALLS.c[k] == bindparam(f"m_{k}") for k in match),
               *(CLAIMABLE if claim else ()))
        # SET evaluates right-hand sides against the old row, so prev_status keeps the status
        # we moved from, for the event row.
        .values(prev_status=CALLS.c.status, status=to.value, **extra,
                **{k: _value(k, json_as_text) for k in fields})
    )


def _value(column: str, json_as_text: bool) -> Any:
    """The parameter ``v_<column>`` of :func:`_guarded_update`."""
    if json_as_text and isinstance(CALLS.c[column].type, JsonText):
        return jsonb_text(f"v_{column}")
    return bindparam(f"v_{column}")


@functools.lru_cache(maxsize=256)
def _transition_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...], postgres: bool,
) -> Any:
    """The guarded UPDATE of one transition shape, returning what ``_record`` needs."""
    return _guarded_update(to, sources, match, fields).returning(*_returning_one(to, postgres))


# The single-statement form's event detail and time, bound per move. Its JSON (the details,
# and the JSON columns it writes: a result, arguments) is bound as text and cast by the server
# (``sqljson.jsonb_text``): bound as its column type, each value was parsed here, walked and
# written out again by psycopg: about a fifth of the ending's client CPU (its statements in
# ``python -m bench child --store postgres``: 291 against 224 µs a call, the medians of six
# alternating runs, issue 29).
_EV_DETAIL = jsonb_text("ev_detail")
_EV_NOW = bindparam("ev_now", type_=EVENTS.c.created_at.type)
# The start event's, for a move that ends an attempt whose start was not stored.
_ST_DETAIL = jsonb_text("st_detail")
_ST_NOW = bindparam("st_now", type_=EVENTS.c.created_at.type)
# Takes the session's delivery lock and then says whether the session has user messages
# waiting, reading at a snapshot of its own (migration 0008): see ``single_statement``.
SESSION_ENDED_CHECK = "dex_call_ended_check"


@functools.lru_cache(maxsize=256)
def single_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...], claim: bool = False, started: bool = False,
) -> Any:
    """PostgreSQL: one move as ONE statement, run in autocommit (one round trip, no BEGIN or
    COMMIT): the guarded UPDATE, its event row and, on a move to a terminal status, the call's
    tool message, as data-modifying CTEs that write only what the UPDATE returned.

    A terminal move's RETURNING also calls ``dex_call_ended_check`` (migration 0008), which
    takes the session's delivery lock and then reads whether user messages wait: a VOLATILE
    function reads at a snapshot taken after the lock, so it sees what the lock's previous
    holder committed, as the statements after the UPDATE do in the transaction form. When it
    says yes, the caller delivers them in a transaction of its own (rare; the sweep is the
    backstop). A claim (``claim``) returns the whole row. ``started``: the move ends an
    attempt whose start was not stored (a retrying call, leased in Redis): its
    ``tool_call_started`` event (``:st_detail`` at ``:st_now``) is written first, in the same
    INSERT, and the ending's event says it left ``running``. Its JSON values and event
    details are sent as text the server casts to jsonb (``sqljson.jsonb_text``).
    """
    update_stmt = _guarded_update(to, sources, match, fields, claim=claim, json_as_text=True)
    if claim:
        returned: tuple[Any, ...] = tuple(CALLS.c)
    elif to.terminal:
        returned = (*_RETURNING_TERMINAL, func.dex_call_ended_check(
            literal_column(str(DELIVERY_LOCK_SPACE)), CALLS.c.session_id).label("queued"))
    else:
        returned = _RETURNING
    moved = update_stmt.returning(*returned).cte("moved")
    detail: Any = (func.jsonb_build_object(literal_column("'attempt'"), moved.c.attempts,
                                           literal_column("'worker'"), moved.c.worker)
                   if claim else _EV_DETAIL)
    ended = select(moved.c.session_id, moved.c.key, literal_column(f"'{event_name(to)}'"),
                   literal_column(f"'{CallStatus.RUNNING.value}'") if started
                   else moved.c.prev_status, literal_column(f"'{to.value}'"), detail, _EV_NOW)
    rows: Any = ended
    if started:
        # One INSERT of both rows, the start first, so their ids keep their order.
        rows = select(moved.c.session_id, moved.c.key,
                      literal_column(f"'{event_name(CallStatus.RUNNING)}'"),
                      moved.c.prev_status, literal_column(f"'{CallStatus.RUNNING.value}'"),
                      _ST_DETAIL, _ST_NOW).union_all(ended)
    event = insert(EVENTS).from_select(
        ["session_id", "key", "event", "from_status", "to_status", "detail", "created_at"],
        rows,
    ).cte("moved_event")
    stmt = select(moved).add_cte(event)
    if to.terminal:
        output = (cast(moved.c.result, Text) if to is CallStatus.SUCCEEDED
                  else moved.c.error)
        message = insert(MESSAGES).from_select(
            ["session_id", "role", "created_at", "turn_id", "tool_call_id", "tool", "key",
             "call_status", "tool_arguments", "tool_output"],
            select(moved.c.session_id, literal_column(f"'{MessageRole.TOOL.value}'"), _EV_NOW,
                   moved.c.turn_id, moved.c.tool_call_id, moved.c.tool, moved.c.key,
                   literal_column(f"'{to.value}'"), moved.c.arguments, output),
        ).cte("moved_message")
        stmt = stmt.add_cte(message)
    return stmt


def _event_row(row: Any, to: CallStatus, detail: Mapping[str, Any] | None,
               now: float, from_status: str | None = None) -> dict[str, Any]:
    """The event row of one move: ``row`` is what its UPDATE returned."""
    return {"session_id": row.session_id, "key": row.key, "event": event_name(to),
            "from_status": from_status or row.prev_status, "to_status": to.value,
            "detail": json.dumps(dict(detail), default=str) if detail else None,
            "created_at": now}


def _tool_message(row: Any, to: CallStatus, now: float) -> dict[str, Any]:
    """The transcript's tool message of a call that just became terminal (``to``)."""
    return {"session_id": row.session_id, "role": MessageRole.TOOL.value, "text": None,
            "status": None, "created_at": now, "delivered_at": None, "turn_id": row.turn_id,
            "tool_call_id": row.tool_call_id, "tool": row.tool, "key": row.key,
            "call_status": to.value, "tool_arguments": row.arguments,
            "tool_output": row.result if to is CallStatus.SUCCEEDED else row.error}


@dataclass(frozen=True)
class Started:
    """The start of an attempt that was not stored when it began (a retrying call's, leased in
    Redis): recorded by the move that ends the attempt, as its ``tool_call_started`` event."""

    at: float
    detail: Mapping[str, Any]


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




class Transitions(StoreBase):
    """The guarded status changes of :class:`~dex_tasks.store.Store`."""

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
        started: Started | None = None,
    ) -> bool:
        """Move call ``key`` to ``to`` if its status is one of ``allowed``; True if this won.

        ``allowed`` defaults to every legal predecessor and must be a subset of them.
        ``match`` adds equality guards on columns (the owning worker, an attempt count) and
        ``where`` any other guard; ``values`` sets other columns in the same statement. The
        event row is written in the same transaction, and so is, when ``to`` is terminal, the
        call's tool message in the session's transcript. Without ``conn`` the transition runs
        in a transaction of its own, retried across a lost connection (see the module's doc).

        ``started``: this move ends an attempt whose start was never stored (a retrying call
        runs leased in Redis, ``broker/runs.py``): the ``tool_call_started`` event it would
        have written is written now, before the ending's, in the same statement.
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
            return self._transition_in(conn, stmt, params, key, to, detail, now,
                                       started) is not None
        if params is not None and self.is_postgres:
            single = single_statement(to, sources, tuple(sorted(match)), tuple(sorted(fields)),
                                      started=started is not None)
            if started is not None:
                params = {**params, "st_now": started.at,
                          "st_detail": json.dumps(started.detail, default=str)}
            return self._move_single(single, params, key, to, detail, now,
                                     {**match, **fields}) is not None

        def attempt(tx: Connection, n: int) -> bool:
            if self._transition_in(tx, stmt, params, key, to, detail, now,
                                   started) is not None:
                return True
            # Nothing matched. After a lost connection that may be our own earlier try, which
            # committed: the row then holds exactly what this transition writes.
            return n > 1 and self._landed(tx, key, to, {**match, **fields}, now) is not None

        # Statements built once per shape go to SQLite's driver, and so can its transaction.
        return self._retrying(attempt, on_driver=params is not None)

    def _move_single(self, stmt: Any, params: dict[str, Any], key: str, to: CallStatus,
                     detail: Mapping[str, Any] | None, now: float,
                     written: Mapping[str, Any]) -> Any | None:
        """Run one move's single statement (:func:`single_statement`) in autocommit, retried
        across a lost connection; the row it returned, or None if the guards did not hold.

        A statement whose reply was lost may have committed: the retry finds nothing to move,
        and :meth:`_landed` then recognises the row that try left (its values, its
        ``updated_at``), taken as won. The user messages a call's end releases are delivered
        in a transaction of their own, and only then is the end announced (the hooks of
        :meth:`committing` run once ``attempt`` has returned): a waiter woken by the end reads
        the session as the transaction form leaves it, its messages delivered."""
        bound = {**params, "ev_now": now,
                 "ev_detail": json.dumps(dict(detail), default=str) if detail else None}

        def attempt(conn: Connection, n: int) -> Any | None:
            rows = driver.run(conn, stmt, bound)
            row = rows[0] if rows else None
            if row is not None:
                if to.terminal:
                    note_ended(conn, key, to, row, now)
                    if row.queued:
                        self._deliver_released(row.session_id, now)
                return row
            # After a lost reply, the first try may have committed (and found messages
            # waiting): a landed terminal move delivers them again, which is idempotent.
            landed = self._landed(conn, key, to, written, now) if n > 1 else None
            if landed is not None and to.terminal:
                self._deliver_released(landed.session_id, now)
            return landed

        return self._retrying(attempt, single=True)

    def _deliver_released(self, session_id: str, now: float) -> None:
        """Deliver the queued user messages of a session whose call just ended, in a
        transaction of its own. A store that cannot be reached now leaves them queued for the
        sweep that delivers them (``deliver_messages``), never failing the move that
        committed."""
        try:
            with self.write() as tx:
                deliver_ready_messages(tx, now, session_id)
        except DexError as err:
            log.warning("the messages a call's end released are left to the sweep",
                        extra={"action": "delivery_deferred", "session_id": session_id,
                               "error": str(err)[:300]})

    def _transition_in(
        self,
        conn: Connection,
        stmt: Any,
        params: dict[str, Any] | None,
        key: str,
        to: CallStatus,
        detail: Mapping[str, Any] | None,
        now: float,
        started: Started | None = None,
    ) -> Any | None:
        if params is not None:  # a statement built once per shape: prepared on SQLite
            rows = driver.run(conn, stmt, params)
            row = rows[0] if rows else None
        else:
            row = conn.execute(stmt).first()
        if row is None:
            return None
        # A terminal move on PostgreSQL took the session's delivery lock in its RETURNING.
        self._record(conn, to, [row], {key: detail}, now, locked=True, started=started)
        return row

    def _record(self, conn: Connection, to: CallStatus, moved: Sequence[Any],
                details: Mapping[str, Mapping[str, Any] | None], now: float, *,
                locked: bool, started: Started | None = None) -> None:
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
        ``started``: the one call moved ends an attempt whose start was not stored (see
        :meth:`transition`); its ``tool_call_started`` event goes first, in the same INSERT.
        """
        if started is not None:
            (row,) = moved
            events = [_event_row(row, CallStatus.RUNNING, started.detail, started.at),
                      _event_row(row, to, details[row.key], now, CallStatus.RUNNING.value)]
        else:
            events = [_event_row(row, to, details[row.key], now) for row in moved]
        if not events:
            return
        if not to.terminal:
            driver.run_many(conn, INSERT_EVENT, events)
            return
        for row in moved:
            note_ended(conn, row.key, to, row, now)
        driver.run_many(conn, INSERT_MESSAGE, [_tool_message(row, to, now) for row in moved])
        sessions: list[str] = sorted({e["session_id"] for e in events})
        if self.is_postgres and not locked:
            conn.execute(DELIVERY_LOCK_MANY, {"space": DELIVERY_LOCK_SPACE,
                                               "sessions": sessions})
        if len(moved) == 1:
            # The event rows and whether the session has messages waiting, in one statement.
            if started is not None:
                queued = driver.run(conn, INSERT_EVENT_PAIR_QUEUED, {
                    **{f"{c}_{i}": v for i, e in enumerate(events) for c, v in e.items()},
                    "queued_session": sessions[0]})[0].queued
            else:
                queued = driver.run(conn, INSERT_EVENT_QUEUED,
                                    {**events[0], "queued_session": sessions[0]})[0].queued
            waiting = sessions if queued else []
        else:
            driver.run_many(conn, INSERT_EVENT, events)
            waiting = list(conn.execute(SESSIONS_WITH_QUEUED,
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
        guards += [equals(column, value) for column, value in written.items()
                   if not isinstance(value, ClauseElement)]
        row = conn.execute(select(CALLS).where(*guards)).first()
        if row is not None:
            log.warning("a transition whose connection was lost had committed; taken as won",
                        extra={"action": "store_commit_recovered", "key": key,
                               "status": to.value})
            if to.terminal:
                note_ended(conn, key, to, row, now)
        return row

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
                fields[column] = cast(case({k: bound(column, v) for k, v in values.items()},
                                           value=CALLS.c.key), CALLS.c[column].type)
        guard = or_(*(and_(CALLS.c.key == m.key, *(equals(c, m.match[c]) for c in guarded))
                      for m in chunk))
        rows = conn.execute(
            update(CALLS)
            .where(status_by_key(self.is_sqlite).in_(sorted(s.value for s in sources)), guard)
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
                                        status_by_key(self.is_sqlite) == to.value,
                                        CALLS.c.updated_at == now)):
                landed.add(row.key)
                if to.terminal:
                    note_ended(conn, row.key, to, row, now)
        if landed:
            log.warning("a set-based transition whose connection was lost had committed",
                        extra={"action": "store_commit_recovered", "count": len(landed)})
        return landed
