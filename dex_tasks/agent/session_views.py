"""What a session's approvals look like to its readers: the snapshot (calls, transcript,
pending and decided approvals in one consistent read), the pending list, one interrupt, and
why a decision would be refused now.

Reads only; deciding is ``approvals.py``'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, or_, select
from sqlalchemy.engine import Connection, CursorResult

from dex_tasks.errors import InvalidArgumentError
from dex_tasks.policy import EffectClass
from dex_tasks.states import TERMINAL, CallStatus
from dex_tasks.store import APPROVALS, CALLS, INTERRUPTS, MESSAGES, Store
from dex_tasks.store.models import InterruptRow
from dex_tasks.store.records import (
    AgentSnapshot,
    Decision,
    PendingInterrupt,
    SessionMessage,
    ToolCallRecord,
)
from dex_tasks.store.transcript import session_messages, with_edit_notes

if TYPE_CHECKING:
    from dex_tasks.broker.runs import Runs


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


def _rows(result: CursorResult[Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in result.mappings()]


def _pending(interrupt: Mapping[str, Any], call: Mapping[str, Any],
             approvers: Mapping[str, list[str]]) -> PendingInterrupt:
    return PendingInterrupt(
        interrupt_id=interrupt["interrupt_id"], session_id=interrupt["session_id"],
        key=call["key"], tool=call["tool"], arguments=json.loads(call["arguments"]),
        effect=EffectClass(call["effect"]), deadline=_dt(interrupt["deadline_at"]),
        created_at=_dt(interrupt["created_at"]),
        approvals_required=interrupt.get("approvals_required") or 1,
        approved_by=approvers.get(interrupt["interrupt_id"], []),
        approver_permission=interrupt.get("approver_permission"),
        original_arguments=_json_or_none(call.get("original_arguments")),
    )


def _json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _decided(interrupt: Mapping[str, Any], call: Mapping[str, Any],
             approvers: Mapping[str, list[str]]) -> Decision:
    return Decision(
        interrupt_id=interrupt["interrupt_id"], key=call["key"], tool=call["tool"],
        arguments=json.loads(call["arguments"]), effect=EffectClass(call["effect"]),
        decision=interrupt["decision"], decided_by=interrupt["decided_by"],
        decided_at=_dt(interrupt["decided_at"]), reason=interrupt["reason"],
        deadline=_dt(interrupt["deadline_at"]), call_status=CallStatus(call["status"]),
        approved_by=approvers.get(interrupt["interrupt_id"], []),
        original_arguments=_json_or_none(call.get("original_arguments")),
    )


def _approvals_of(conn: Connection, interrupt_ids: list[str]) -> dict[str, list[str]]:
    """Who approved each of these interrupts (those that need several), in order."""
    found: dict[str, list[str]] = {}
    if not interrupt_ids:
        return found
    for row in conn.execute(select(APPROVALS).where(APPROVALS.c.interrupt_id.in_(interrupt_ids))
                            .order_by(APPROVALS.c.decided_at, APPROVALS.c.approver)):
        found.setdefault(row.interrupt_id, []).append(row.approver)
    return found


@dataclass(frozen=True)
class SnapshotWindow:
    """Which part of a session :func:`session_snapshot` reads: at most ``limit`` of each list.

    ``messages_after`` / ``messages_before``: only messages with an id in between (with
    ``messages_before``, the newest ``limit`` of them, returned oldest first: the transcript's
    tail). ``calls_after``: only calls after that call (its key) in the ``(created_at, key)``
    order; ``open_calls``: only calls that have not ended. Pending approvals are the oldest
    ``limit``, decided ones the newest ``limit``.
    """

    limit: int
    messages_after: int = 0
    messages_before: int | None = None
    calls_after: str | None = None
    open_calls: bool = False


def _calls_query(session_id: str, window: SnapshotWindow | None, conn: Connection) -> Any:
    query = select(CALLS).where(CALLS.c.session_id == session_id)
    if window is None:
        return query.order_by(CALLS.c.created_at, CALLS.c.key)
    if window.calls_after is not None:
        after = conn.execute(select(CALLS.c.created_at).where(
            CALLS.c.session_id == session_id, CALLS.c.key == window.calls_after)).first()
        if after is None:
            raise InvalidArgumentError(f"calls_after must be the key of a call of session "
                                       f"{session_id!r}, got {window.calls_after!r}")
        query = query.where(or_(CALLS.c.created_at > after.created_at,
                                and_(CALLS.c.created_at == after.created_at,
                                     CALLS.c.key > window.calls_after)))
    if window.open_calls:
        query = query.where(CALLS.c.status.not_in([s.value for s in TERMINAL]))
    return query.order_by(CALLS.c.created_at, CALLS.c.key).limit(window.limit)


def _messages(conn: Connection, session_id: str,
              window: SnapshotWindow | None) -> list[SessionMessage]:
    if window is None:
        return session_messages(conn, session_id)
    query = select(MESSAGES).where(MESSAGES.c.session_id == session_id,
                                   MESSAGES.c.id > window.messages_after)
    if window.messages_before is None:
        query = query.order_by(MESSAGES.c.id).limit(window.limit)
        rows = list(conn.execute(query).mappings())
    else:
        query = (query.where(MESSAGES.c.id < window.messages_before)
                 .order_by(MESSAGES.c.id.desc()).limit(window.limit))
        rows = list(conn.execute(query).mappings())[::-1]
    return with_edit_notes(conn, session_id, [SessionMessage.from_row(dict(row))
                                              for row in rows])


def session_snapshot(store: Store, session_id: str, now: float | None = None,
                     window: SnapshotWindow | None = None,
                     runs: Runs | None = None) -> AgentSnapshot:
    """The session as one consistent read: calls, transcript, pending and decided approvals
    (all of them; only ``window``'s part when given, which is what the HTTP API serves).

    ``runs``: the retrying calls' running attempts in Redis (``broker/runs.py``); a call the
    store has ``queued`` that one of them runs is shown ``running``.

    An undecided interrupt whose deadline has passed is in neither list: it can no longer be
    approved, and the next deadline sweep moves it to ``decided`` as expired.
    """
    now = time.time() if now is None else now
    limit = None if window is None else window.limit
    joined = select(INTERRUPTS, CALLS.c.tool, CALLS.c.arguments, CALLS.c.effect,
                    CALLS.c.status, CALLS.c.original_arguments
                    ).join(CALLS, CALLS.c.key == INTERRUPTS.c.key)
    open_query = (joined.where(INTERRUPTS.c.session_id == session_id,
                               INTERRUPTS.c.decision.is_(None),
                               or_(INTERRUPTS.c.deadline_at.is_(None),
                                   INTERRUPTS.c.deadline_at > now))
                  .order_by(INTERRUPTS.c.created_at, INTERRUPTS.c.interrupt_id).limit(limit))
    decided_query = (joined.where(INTERRUPTS.c.session_id == session_id,
                                  INTERRUPTS.c.decision.is_not(None))
                     .order_by(INTERRUPTS.c.decided_at.desc(), INTERRUPTS.c.interrupt_id)
                     .limit(limit))

    def read(conn: Connection) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                        list[dict[str, Any]], list[SessionMessage],
                                        dict[str, list[str]]]:
        if store.is_postgres:
            # One snapshot for every statement below: under READ COMMITTED a decision
            # committed between them showed the call awaiting approval in one list and
            # decided in another. Read-only REPEATABLE READ never fails to serialise.
            conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        calls = _rows(conn.execute(_calls_query(session_id, window, conn)))
        pending = _rows(conn.execute(open_query))
        decided = _rows(conn.execute(decided_query))
        several = [i["interrupt_id"] for i in (*pending, *decided)
                   if (i["approvals_required"] or 1) > 1]
        return (calls, pending, decided, _messages(conn, session_id, window),
                _approvals_of(conn, several))

    # Retried across a lost connection: agents read their session between every turn.
    calls, pending, decided, messages, approvers = store.reading(read)
    return AgentSnapshot(
        session_id=session_id,
        tool_calls=_shown(runs, [ToolCallRecord.from_mapping(c)
                                 for c in calls]),
        messages=messages,
        pending_interrupts=[_pending(i, i, approvers) for i in pending],
        decided=[_decided(i, i, approvers) for i in reversed(decided)],
    )


def _shown(runs: Runs | None, records: list[ToolCallRecord]) -> list[ToolCallRecord]:
    return records if runs is None else runs.overlay(records)


def list_pending(
    store: Store, session_id: str | None = None, now: float | None = None, limit: int = 1000
) -> list[PendingInterrupt]:
    """Pending approvals (of one session, or of all), oldest first."""
    now = time.time() if now is None else now
    query = (
        select(INTERRUPTS, CALLS.c.tool, CALLS.c.arguments, CALLS.c.effect,
               CALLS.c.original_arguments)
        .join(CALLS, CALLS.c.key == INTERRUPTS.c.key)
        .where(INTERRUPTS.c.decision.is_(None),
               or_(INTERRUPTS.c.deadline_at.is_(None), INTERRUPTS.c.deadline_at > now))
        .order_by(INTERRUPTS.c.created_at, INTERRUPTS.c.interrupt_id)
        .limit(limit)
    )
    if session_id is not None:
        query = query.where(INTERRUPTS.c.session_id == session_id)

    def read(conn: Connection) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
        rows = _rows(conn.execute(query))
        several = [r["interrupt_id"] for r in rows if (r["approvals_required"] or 1) > 1]
        return rows, _approvals_of(conn, several)

    rows, approvers = store.reading(read)
    return [_pending(r, r, approvers) for r in rows]


def get_interrupt(store: Store, interrupt_id: str) -> InterruptRow | None:
    """One interrupt row (decided or not), or None."""
    with store.read() as conn:
        row = conn.execute(
            select(INTERRUPTS).where(INTERRUPTS.c.interrupt_id == interrupt_id)
        ).mappings().first()
    return InterruptRow.model_validate(dict(row)) if row else None


UNKNOWN_INTERRUPT = "unknown_interrupt"
WRONG_SESSION = "wrong_session"
ALREADY_DECIDED = "already_decided"
DEADLINE_PASSED = "deadline_passed"
REFUSAL_REASONS = (UNKNOWN_INTERRUPT, WRONG_SESSION, ALREADY_DECIDED, DEADLINE_PASSED)
"""Why :func:`resolve_interrupt` answered False, as :func:`refusal_reason` names it."""


def refusal_reason(store: Store, session_id: str, interrupt_id: str,
                   now: float | None = None) -> str | None:
    """Why a decision of this interrupt in this session is refused now, or None if it can
    still be decided: one of :data:`REFUSAL_REASONS`.

    A read after the fact, so ``resolve_interrupt`` keeps its bool: ask this when it answered
    False. An interrupt of another session is ``wrong_session`` only to a caller who may know
    it exists (the HTTP API answers ``unknown_interrupt`` for both).
    """
    now = time.time() if now is None else now
    row = get_interrupt(store, interrupt_id)
    if row is None:
        return UNKNOWN_INTERRUPT
    if row.session_id != session_id:
        return WRONG_SESSION
    if row.decision is not None:
        return ALREADY_DECIDED
    if row.deadline_at is not None and row.deadline_at <= now:
        return DEADLINE_PASSED
    return None
