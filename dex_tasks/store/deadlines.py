"""Approval deadlines: the sweep that rejects calls whose approval deadline passed undecided.

One statement marks overdue undecided interrupts ``expired`` and, in the same transaction, one
set-based transition rejects their calls; it reads only overdue rows, through the
``(decision, deadline_at)`` index. A person's decision (``agent/approvals.py``) guards on the
same ``decision IS NULL`` in the same row, so exactly one of them wins. Beat runs the sweep
(``worker/sweeps.py``); the texts below are also what a person's decision writes.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, Update, select, update

from dex_tasks.states import CallStatus
from dex_tasks.store import INTERRUPTS, Move, Store, webhooks
from dex_tasks.tracing import approvals_decided

log = logging.getLogger("dex_tasks.store.deadlines")

APPROVAL_REJECTED = "APPROVAL_REJECTED"
"""Prefix of the error of a call a person rejected; their message follows."""

APPROVAL_DEADLINE_PASSED = "APPROVAL_DEADLINE_PASSED"
"""Prefix of the error of a call rejected because its approval deadline passed undecided."""

APPROVED = "approved"
REJECTED = "rejected"
EXPIRED = "expired"

EXPIRE_BATCH = 500


def deadline_error(deadline_at: float | None) -> str:
    """The error of a call whose approval deadline passed with no decision."""
    when = iso_time(deadline_at) if deadline_at is not None else "its deadline"
    return (f"{APPROVAL_DEADLINE_PASSED}: the tool did not run; its approval deadline ({when}) "
            "passed before anyone approved it")


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")



def expire_statement(now: float, through: float | None = None) -> Update:
    """The deadline sweep's statement: mark undecided interrupts whose deadline passed
    ``expired``, returning their calls' keys.

    A plain guarded ``UPDATE``, so the planner reads the ``(decision, deadline_at)`` index with
    both bounds: O(overdue rows), never O(pending). ``through`` (a deadline before ``now``)
    bounds a batch. Concurrent runs serialise on each row and re-check ``decision IS NULL``:
    the second finds nothing. Rows are locked in index order, so two sweeps do not deadlock.
    """
    due = INTERRUPTS.c.deadline_at < now if through is None else (
        INTERRUPTS.c.deadline_at <= through)
    return (
        update(INTERRUPTS)
        .where(INTERRUPTS.c.decision.is_(None), due)
        .values(decision=EXPIRED, decided_by=None, decided_at=now,
                reason="the approval deadline passed")
        .returning(INTERRUPTS.c.key, INTERRUPTS.c.interrupt_id, INTERRUPTS.c.deadline_at)
    )


def batch_bound(now: float, batch: int) -> Select[Any]:
    """The deadline of the ``batch``-th overdue interrupt (none if fewer are overdue)."""
    return (
        select(INTERRUPTS.c.deadline_at)
        .where(INTERRUPTS.c.decision.is_(None), INTERRUPTS.c.deadline_at < now)
        .order_by(INTERRUPTS.c.deadline_at)
        .offset(batch)
        .limit(1)
    )


def expire_overdue(store: Store, now: float | None = None, batch: int = EXPIRE_BATCH) -> int:
    """Reject every call whose approval deadline passed undecided; returns how many.

    Each transaction runs :func:`expire_statement` and the calls' guarded set-based transition
    (``Store.transition_many``). After an outage the backlog may be large, so a transaction
    takes about ``batch`` of the oldest deadlines (ties included) and the loop continues until
    none is left. Idempotent and safe to run concurrently.
    """
    now = time.time() if now is None else now
    total = 0
    while True:
        count, more = _expire_batch(store, now, batch)
        total += count
        if not more:
            return total


def _expire_batch(store: Store, now: float, batch: int) -> tuple[int, bool]:
    with store.write() as conn:
        through = conn.execute(batch_bound(now, batch)).scalar()
        rows = conn.execute(expire_statement(now, through)).all()
        rejected = store.transition_many(
            [Move(row.key, CallStatus.REJECTED, values={"error": deadline_error(row.deadline_at)},
                  detail={"reason": EXPIRED, "interrupt_id": row.interrupt_id})
             for row in rows],
            allowed={CallStatus.AWAITING_APPROVAL}, now=now, conn=conn,
        )
        webhooks.announce_keys(conn, store, webhooks.DECIDED, sorted(rejected), now)
    for row in rows:
        if row.key in rejected:
            log.info("approval deadline passed", extra={"action": "approval_expired",
                                                         "key": row.key})
        else:
            log.error("expired interrupt's call was not awaiting approval",
                      extra={"action": "interrupt_inconsistent", "key": row.key,
                             "interrupt_id": row.interrupt_id})
    approvals_decided(store, sorted(rejected), EXPIRED, None, now)  # OpenTelemetry, when on
    return len(rows), through is not None


def warn_near_deadlines(store: Store, lead_seconds: float, now: float | None = None,
                        batch: int = EXPIRE_BATCH) -> int:
    """Announce ``approval_deadline_near`` once for each undecided interrupt whose deadline
    falls within ``lead_seconds`` from now; returns how many.

    One guarded ``UPDATE`` (``deadline_warned_at IS NULL``) reads the ``(decision,
    deadline_at)`` index between now and now + lead: O(interrupts due soon), never O(pending).
    Two sweeps at once serialise on the rows and the second finds them warned. The events are
    written in the same transaction (``store/webhooks.py``).
    """
    now = time.time() if now is None else now
    with store.write() as conn:
        keys = list(conn.execute(
            update(INTERRUPTS)
            .where(INTERRUPTS.c.decision.is_(None), INTERRUPTS.c.deadline_at >= now,
                   INTERRUPTS.c.deadline_at <= now + lead_seconds,
                   INTERRUPTS.c.deadline_warned_at.is_(None),
                   INTERRUPTS.c.interrupt_id.in_(
                       select(INTERRUPTS.c.interrupt_id)
                       .where(INTERRUPTS.c.decision.is_(None),
                              INTERRUPTS.c.deadline_at >= now,
                              INTERRUPTS.c.deadline_at <= now + lead_seconds,
                              INTERRUPTS.c.deadline_warned_at.is_(None))
                       .order_by(INTERRUPTS.c.deadline_at).limit(batch)))
            .values(deadline_warned_at=now)
            .returning(INTERRUPTS.c.key)).scalars())
        webhooks.announce_keys(conn, store, webhooks.DEADLINE_NEAR, keys, now)
    return len(keys)
