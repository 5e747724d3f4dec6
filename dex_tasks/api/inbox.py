"""The operator's inbox: the sessions with approvals waiting, newest request first.

One grouped read of the undecided interrupts (through the ``(decision, deadline_at)`` index),
bounded by ``limit``: O(pending approvals), which is what an operator is there to work through.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from urllib.parse import quote

from sqlalchemy import func, or_, select

from dex_tasks.api.schemas import PendingSession, PendingSessions
from dex_tasks.store import INTERRUPTS, Store

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def session_page_path(session_id: str) -> str:
    """The path of a session's page (``/sessions/<id>``, the id percent-encoded)."""
    return f"/sessions/{quote(session_id, safe='')}"


def pending_sessions(store: Store, limit: int = DEFAULT_LIMIT,
                     now: float | None = None) -> PendingSessions:
    """Sessions with at least one approval waiting (undecided, deadline not passed), the one
    whose latest waiting call is newest first; at most ``limit`` of them."""
    now = time.time() if now is None else now
    newest = func.max(INTERRUPTS.c.created_at).label("newest")
    query = (
        select(INTERRUPTS.c.session_id, func.count().label("pending"), newest,
               func.min(INTERRUPTS.c.created_at).label("oldest"),
               # MIN ignores NULL: the earliest deadline among those that have one.
               func.min(INTERRUPTS.c.deadline_at).label("next_deadline"))
        .where(INTERRUPTS.c.decision.is_(None),
               or_(INTERRUPTS.c.deadline_at.is_(None), INTERRUPTS.c.deadline_at > now))
        .group_by(INTERRUPTS.c.session_id)
        .order_by(newest.desc(), INTERRUPTS.c.session_id)
        .limit(limit + 1)  # one more than asked: tells whether the list was cut
    )
    with store.read() as conn:
        rows = conn.execute(query).all()
    sessions = [
        PendingSession(
            session_id=row.session_id, pending=row.pending,
            newest_request_at=_dt(row.newest), oldest_request_at=_dt(row.oldest),
            next_deadline=None if row.next_deadline is None else _dt(row.next_deadline),
            page=session_page_path(row.session_id),
        )
        for row in rows[:limit]
    ]
    return PendingSessions(sessions=sessions, truncated=len(rows) > limit)


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)
