"""Approvals: interrupts, their decisions and deadlines; the session snapshot.

A call that needs approval is stored ``awaiting_approval`` with an interrupt row (see
``DexClient.call_tool``); no Celery message exists for it, so it holds no worker and survives
any restart. This module decides interrupts:

* :func:`resolve_interrupt` - a person's decision. One transaction: a guarded ``UPDATE`` of the
  interrupt (undecided, in this session, deadline not passed) whose row count says whether this
  caller decided, and the call's guarded transition. The first decision wins; every later one,
  and one that arrives after the deadline, changes nothing.
* the deadline sweep (``store/deadlines.py``), run by beat, rejects calls whose deadline passed.

Both sides of a race (two people, a person and the sweep, two sweeps) guard on
``decision IS NULL`` in the same row, so exactly one wins.

Turns and messages: a user message sent while a turn of the session is open (one of its calls
is awaiting approval, queued or running) is stored ``queued`` and delivered when the turn ends;
see ``transcript.py``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from sqlalchemy import and_, or_, select, update
from sqlalchemy.engine import Connection, CursorResult

from dex_tasks.broker.celery_app import publish
from dex_tasks.errors import InvalidArgumentError
from dex_tasks.limits import (
    APPROVER_MAX,
    INTERRUPT_ID_MAX,
    SESSION_ID_MAX,
    check_id,
    check_text,
)
from dex_tasks.policy import EffectClass
from dex_tasks.states import TERMINAL, CallStatus
from dex_tasks.store import CALLS, INTERRUPTS, MESSAGES, Store
from dex_tasks.store.deadlines import (
    APPROVAL_REJECTED,
    APPROVED,
    REJECTED,
)
from dex_tasks.store.models import InterruptRow, ToolCallRow
from dex_tasks.store.records import (
    AgentSnapshot,
    Decision,
    PendingInterrupt,
    SessionMessage,
    ToolCallRecord,
)
from dex_tasks.store.transcript import session_messages

log = logging.getLogger("dex_tasks.agent.approvals")

def rejection_error(approver: str | None, message: str | None) -> str:
    """The error a rejected call carries, which the model reads: who rejected it and why."""
    who = approver or "a reviewer"
    why = f": {message}" if message else " (no message given)"
    return f"{APPROVAL_REJECTED}: the tool did not run; rejected by {who}{why}"


def _dt(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


class _CallNotAwaiting(Exception):
    """The interrupt was undecided but its call is not awaiting approval: roll back."""


# -- a person's decision ------------------------------------------------------------------------


def resolve_interrupt(
    store: Store,
    app: Celery,
    session_id: str,
    interrupt_id: str,
    approved: bool,
    rejection_message: str | None = None,
    approver: str | None = None,
    now: float | None = None,
) -> bool:
    """Decide a pending approval; True if this call decided it, False if it changed nothing.

    False for an interrupt already decided (by anyone, or expired by the sweep), one whose
    deadline has passed (even before the sweep ran), one that does not exist, or one of another
    session: safe to retry. Approving moves the call to ``queued`` and publishes it after the
    commit; if that publish fails the call stays ``queued`` and the stranded-call republisher
    sends it. Rejecting moves it to ``rejected`` with :func:`rejection_error` as its error.
    ``rejection_message`` is ignored when approving.
    """
    check_id("session_id", session_id, SESSION_ID_MAX)
    check_id("interrupt_id", interrupt_id, INTERRUPT_ID_MAX)
    if not isinstance(approved, bool):
        raise InvalidArgumentError(f"approved must be a boolean, got {type(approved).__name__}")
    if rejection_message is not None:
        check_text("rejection_message", rejection_message)
    approver = approver or None
    if approver is not None:
        check_id("approver", approver, APPROVER_MAX)
    now = time.time() if now is None else now
    decision = APPROVED if approved else REJECTED
    reason = None if approved else (rejection_message or None)
    try:
        with store.write() as conn:
            # The compare-and-set of the decision: only an undecided interrupt of this session
            # whose deadline has not passed matches; concurrent deciders serialise on the row
            # and all but the first find decision set.
            row = conn.execute(
                update(INTERRUPTS)
                .where(
                    INTERRUPTS.c.interrupt_id == interrupt_id,
                    INTERRUPTS.c.session_id == session_id,
                    INTERRUPTS.c.decision.is_(None),
                    or_(INTERRUPTS.c.deadline_at.is_(None), INTERRUPTS.c.deadline_at > now),
                )
                .values(decision=decision, decided_by=approver, decided_at=now, reason=reason)
                .returning(INTERRUPTS.c.key)
            ).first()
            if row is None:
                return False
            key: str = row.key
            detail = {"reason": decision, "interrupt_id": interrupt_id, "approver": approver}
            if approved:
                # published_at=now: the republisher leaves it alone while we publish below.
                # The call's queue expiry (``expires_in``) counts from now, not from the
                # request: time spent waiting for a person is not time spent in the queue.
                moved = store.transition(
                    key, CallStatus.QUEUED, allowed={CallStatus.AWAITING_APPROVAL},
                    values={"published_at": now,
                            "expires_at": CALLS.c.expires_at + (now - CALLS.c.created_at)},
                    detail=detail, now=now, conn=conn,
                )
            else:
                moved = store.transition(
                    key, CallStatus.REJECTED, allowed={CallStatus.AWAITING_APPROVAL},
                    values={"error": rejection_error(approver, reason)}, detail=detail,
                    now=now, conn=conn,
                )
            if not moved:
                raise _CallNotAwaiting(key)
    except _CallNotAwaiting as err:
        log.error("interrupt undecided but its call is not awaiting approval",
                  extra={"action": "interrupt_inconsistent", "interrupt_id": interrupt_id,
                         "key": err.args[0]})
        return False
    log.info("interrupt resolved", extra={"action": "interrupt_resolved", "key": key,
                                          "interrupt_id": interrupt_id, "decision": decision,
                                          "approver": approver})
    if approved:
        _publish_approved(store, app, key, now)
    return True


def _publish_approved(store: Store, app: Celery, key: str, approved_at: float) -> None:
    call = store.get_call(key)
    if call is None or call.status != CallStatus.QUEUED.value:
        return
    try:
        publish(app, call)
    except Exception:  # noqa: BLE001 - it stays queued; the republisher sweep sends it
        log.warning("publish after approval failed; left for the republisher",
                    extra={"action": "approval_publish_failed", "key": key})
        # Never published, and said so: the republisher sends a call with no publish at its
        # next sweep once Redis answers, where the published_at of the approval would have
        # kept it waiting a whole window (5 minutes by default). Guarded on that value, so a
        # republish that landed meanwhile is not undone.
        try:
            with store.write() as conn:
                conn.execute(update(CALLS).where(
                    CALLS.c.key == key, CALLS.c.status == CallStatus.QUEUED.value,
                    CALLS.c.published_at == approved_at).values(published_at=None))
        except Exception:  # noqa: BLE001 - the republisher still sends it, a window later
            log.warning("could not mark an approved call unpublished",
                        extra={"action": "approval_publish_failed", "key": key})


def _rows(result: CursorResult[Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in result.mappings()]


# -- views --------------------------------------------------------------------------------------


def _open(interrupt: Mapping[str, Any], now: float) -> bool:
    deadline = interrupt["deadline_at"]
    return interrupt["decision"] is None and (deadline is None or deadline > now)


def _pending(interrupt: Mapping[str, Any], call: Mapping[str, Any]) -> PendingInterrupt:
    return PendingInterrupt(
        interrupt_id=interrupt["interrupt_id"], session_id=interrupt["session_id"],
        key=call["key"], tool=call["tool"], arguments=json.loads(call["arguments"]),
        effect=EffectClass(call["effect"]), deadline=_dt(interrupt["deadline_at"]),
        created_at=_dt(interrupt["created_at"]),
    )


def _decided(interrupt: Mapping[str, Any], call: Mapping[str, Any]) -> Decision:
    return Decision(
        interrupt_id=interrupt["interrupt_id"], key=call["key"], tool=call["tool"],
        arguments=json.loads(call["arguments"]), effect=EffectClass(call["effect"]),
        decision=interrupt["decision"], decided_by=interrupt["decided_by"],
        decided_at=_dt(interrupt["decided_at"]), reason=interrupt["reason"],
        deadline=_dt(interrupt["deadline_at"]), call_status=CallStatus(call["status"]),
    )


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
    return [SessionMessage.from_row(dict(row)) for row in rows]


def session_snapshot(store: Store, session_id: str, now: float | None = None,
                     window: SnapshotWindow | None = None) -> AgentSnapshot:
    """The session as one consistent read: calls, transcript, pending and decided approvals
    (all of them; only ``window``'s part when given, which is what the HTTP API serves).

    An undecided interrupt whose deadline has passed is in neither list: it can no longer be
    approved, and the next deadline sweep moves it to ``decided`` as expired.
    """
    now = time.time() if now is None else now
    limit = None if window is None else window.limit
    joined = select(INTERRUPTS, CALLS.c.tool, CALLS.c.arguments, CALLS.c.effect,
                    CALLS.c.status).join(CALLS, CALLS.c.key == INTERRUPTS.c.key)
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
                                        list[dict[str, Any]], list[SessionMessage]]:
        if store.is_postgres:
            # One snapshot for every statement below: under READ COMMITTED a decision
            # committed between them showed the call awaiting approval in one list and
            # decided in another. Read-only REPEATABLE READ never fails to serialise.
            conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        calls = _rows(conn.execute(_calls_query(session_id, window, conn)))
        pending = _rows(conn.execute(open_query))
        decided = _rows(conn.execute(decided_query))
        return calls, pending, decided, _messages(conn, session_id, window)

    # Retried across a lost connection: agents read their session between every turn.
    calls, pending, decided, messages = store.reading(read)
    return AgentSnapshot(
        session_id=session_id,
        tool_calls=[ToolCallRecord.from_row(ToolCallRow.model_validate(dict(c))) for c in calls],
        messages=messages,
        pending_interrupts=[_pending(i, i) for i in pending],
        decided=[_decided(i, i) for i in reversed(decided)],
    )


def list_pending(
    store: Store, session_id: str | None = None, now: float | None = None, limit: int = 1000
) -> list[PendingInterrupt]:
    """Pending approvals (of one session, or of all), oldest first."""
    now = time.time() if now is None else now
    query = (
        select(INTERRUPTS, CALLS.c.tool, CALLS.c.arguments, CALLS.c.effect)
        .join(CALLS, CALLS.c.key == INTERRUPTS.c.key)
        .where(INTERRUPTS.c.decision.is_(None),
               or_(INTERRUPTS.c.deadline_at.is_(None), INTERRUPTS.c.deadline_at > now))
        .order_by(INTERRUPTS.c.created_at, INTERRUPTS.c.interrupt_id)
        .limit(limit)
    )
    if session_id is not None:
        query = query.where(INTERRUPTS.c.session_id == session_id)
    rows = store.reading(lambda conn: _rows(conn.execute(query)))
    return [_pending(r, r) for r in rows]


def get_interrupt(store: Store, interrupt_id: str) -> InterruptRow | None:
    """One interrupt row (decided or not), or None."""
    with store.read() as conn:
        row = conn.execute(
            select(INTERRUPTS).where(INTERRUPTS.c.interrupt_id == interrupt_id)
        ).mappings().first()
    return InterruptRow.model_validate(dict(row)) if row else None
