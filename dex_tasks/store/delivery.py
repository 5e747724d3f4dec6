"""Delivering queued user messages when their turn ends, and the per-session lock it needs.

A user message sent while a turn of its session is open waits (``queued``) until every turn
that had begun when it was sent has ended; every move that ends a call delivers the messages
its end releases, in its own transaction (``transitions.py``), and a sweep delivers the rest.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, exists, func, literal, select, text, update
from sqlalchemy.engine import Connection

from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store.tables import CALLS, MESSAGES, TURNS

DELIVERY_LOCK_SPACE = 0x64657801  # the first key of dex-tasks' per-session message locks
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


def delivery_statement(*, one_session: bool) -> Any:
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
    # A durable turn (journal.py) holds its session's messages until the model answers
    # without tools, even between its steps, when none of its calls is open.
    open_turn = exists().where(
        TURNS.c.session_id == m.c.session_id, TURNS.c.status == "open",
        TURNS.c.created_at <= m.c.created_at,
    ).correlate(m)
    ready = select(m.c.id).where(m.c.status == "queued", m.c.role == MessageRole.USER.value,
                                 ~open_call, ~open_turn)
    if one_session:
        ready = ready.where(m.c.session_id == bindparam("deliver_session"))
    # A delivered message sits after the session's last message (the one that ended its
    # turn), not where it was sent: the model reads it after the turn's tool messages.
    last = MESSAGES.alias("last")
    last_id = (select(func.max(last.c.id)).where(last.c.session_id == MESSAGES.c.session_id)
               .correlate(MESSAGES).scalar_subquery())
    return (
        update(MESSAGES)
        .where(MESSAGES.c.id.in_(ready.with_for_update(skip_locked=True)),
               MESSAGES.c.status == "queued")
        .values(status="delivered", delivered_at=bindparam("deliver_now"), follows=last_id)
    )


_DELIVER_SESSION = delivery_statement(one_session=True)
_DELIVER_ALL = delivery_statement(one_session=False)
_DELIVERY_LOCK = select(func.pg_advisory_xact_lock(
    literal(DELIVERY_LOCK_SPACE), func.hashtext(bindparam("lock_session"))))
# The same lock, taken inside a terminal transition's UPDATE (in its RETURNING, so only when
# the row moved): it saves a round trip per call. Statements after the UPDATE see every commit
# of the lock's previous holder.
DELIVERY_LOCK_RETURNING = func.pg_advisory_xact_lock(
    literal(DELIVERY_LOCK_SPACE), func.hashtext(CALLS.c.session_id)).label("delivery_lock")
# The same lock on several sessions at once, always in the same (sorted) order, so that two
# set-based transitions never wait on each other in a circle.
DELIVERY_LOCK_MANY = text(
    "SELECT pg_advisory_xact_lock(:space, hashtext(s)) FROM "
    "(SELECT s FROM unnest(CAST(:sessions AS text[])) AS s ORDER BY s) AS sorted_sessions"
)
SESSIONS_WITH_QUEUED = (
    select(MESSAGES.c.session_id).distinct()
    .where(MESSAGES.c.status == "queued",
           MESSAGES.c.session_id.in_(bindparam("queued_sessions", expanding=True)))
)
