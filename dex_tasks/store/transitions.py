"""The one guarded function that changes a call's status, and its set-based twin.

``transition`` (and ``transition_many`` for the sweeps, and ``claim`` in ``leases.py``, the
move to ``running``) is the only code that writes a call's status. It is a compare-and-set
(``UPDATE ... WHERE key = :key AND status IN (:allowed)``) whose row count says whether this
caller won, and it writes the event row in the same transaction (``_record``); a move to a
terminal status also appends the call's tool message to the session's transcript there and
delivers the user messages the end of its turn releases.

On PostgreSQL a transition that runs on its own (no ``conn`` given), the claim included, is ONE
statement in autocommit (``moves.single_statement``): the guarded UPDATE with its event row and
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

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    and_,
    case,
    cast,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ClauseElement, ColumnElement

from dex_tasks.errors import DexError, IllegalTransitionError
from dex_tasks.states import ALLOWED_FROM, CallStatus
from dex_tasks.store import driver
from dex_tasks.store.base import StoreBase, note_ended
from dex_tasks.store.delivery import (
    DELIVERY_LOCK_MANY,
    DELIVERY_LOCK_SPACE,
    SESSIONS_WITH_QUEUED,
    deliver_ready_messages,
)
from dex_tasks.store.moves import (
    detail_text,
    event_row,
    returning,
    returning_one,
    single_statement,
    tool_message,
    transition_statement,
)
from dex_tasks.store.tables import (
    CALLS,
    INSERT_EVENT,
    INSERT_EVENT_PAIR_QUEUED,
    INSERT_EVENT_QUEUED,
    INSERT_MESSAGE,
    bound,
    equals,
    status_by_key,
)

log = logging.getLogger("dex_tasks.store")

# Calls per UPDATE of a set-based transition (its guards and values are bound per call).
_MANY_CHUNK = 200


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




def _has_clause(values: Mapping[str, Any]) -> bool:
    """True if any of ``values`` is a SQL expression, not a plain value (a loop: the
    generator ``any`` takes costs a frame resumption per value, on every move)."""
    for value in values.values():
        if isinstance(value, ClauseElement):
            return True
    return False


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
        if not where and not _has_clause(fields):
            # The common shape (plain values, equality guards): a statement built once per
            # shape and bound here costs a fraction of building one per call.
            matched, written = tuple(sorted(match)), tuple(sorted(fields))
            params = {"t_key": key}
            for k, v in match.items():
                params[f"m_{k}"] = v
            for k, v in fields.items():
                params[f"v_{k}"] = v
            if conn is None and self.is_postgres:
                # One statement in autocommit (see _move_single), bound in this one dict.
                if started is not None:
                    params["st_now"] = started.at
                    params["st_detail"] = detail_text(started.detail, empty="{}")
                return self._move_single(
                    single_statement(to, sources, matched, written,
                                     started=started is not None),
                    params, key, to, detail, now, match, fields) is not None
            stmt = transition_statement(to, sources, matched, written, self.is_postgres)
        else:
            guards = [*where, *(CALLS.c[k] == v for k, v in match.items())]
            stmt = (
                update(CALLS)
                .where(CALLS.c.key == key, CALLS.c.status.in_([s.value for s in sources]),
                       *guards)
                .values(prev_status=CALLS.c.status, status=to.value, **fields)
                .returning(*returning_one(to, self.is_postgres))
            )
        if conn is not None:
            return self._transition_in(conn, stmt, params, key, to, detail, now,
                                       started) is not None

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
                     detail: Mapping[str, Any] | None, now: float, match: Mapping[str, Any],
                     fields: Mapping[str, Any]) -> Any | None:
        """Run one move's single statement (:func:`single_statement`) in autocommit, retried
        across a lost connection; the row it returned, or None if the guards did not hold.

        A statement whose reply was lost may have committed: the retry finds nothing to move,
        and :meth:`_landed` then recognises the row that try left (its values, its
        ``updated_at``), taken as won. The user messages a call's end releases are delivered
        in a transaction of their own, and only then is the end announced (the hooks of
        :meth:`committing` run once ``attempt`` has returned): a waiter woken by the end reads
        the session as the transaction form leaves it, its messages delivered."""
        # ``params`` is a dict the caller built for this move alone: completed in place.
        params["ev_now"] = now
        params["ev_detail"] = detail_text(detail)

        def attempt(conn: Connection, n: int) -> Any | None:
            rows = driver.run(conn, stmt, params)
            row = rows[0] if rows else None
            if row is not None:
                if to.terminal:
                    note_ended(conn, key, to, row, now)
                    if row.queued:
                        self._deliver_released(row.session_id, now)
                return row
            # After a lost reply, the first try may have committed (and found messages
            # waiting): a landed terminal move delivers them again, which is idempotent.
            landed = self._landed(conn, key, to, {**match, **fields}, now) if n > 1 else None
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

        ``moved`` are the rows the UPDATE returned (``moves.returning``), ``details`` each
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
            events = [event_row(row, CallStatus.RUNNING, started.detail, started.at),
                      event_row(row, to, details[row.key], now, CallStatus.RUNNING.value)]
        else:
            events = [event_row(row, to, details[row.key], now) for row in moved]
        if not events:
            return
        if not to.terminal:
            driver.run_many(conn, INSERT_EVENT, events)
            return
        for row in moved:
            note_ended(conn, row.key, to, row, now)
        driver.run_many(conn, INSERT_MESSAGE, [tool_message(row, to, now) for row in moved])
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
            .returning(*returning(to))
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
