"""The store's tables as SQLAlchemy Core, and small pieces every part of the store shares.

The store's code uses Core statements on these tables (``models.py`` defines them as SQLModel
classes): the hot path binds values into statements built once, which costs a fraction of
building one per call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import bindparam, exists, insert, literal, select
from sqlalchemy.sql.elements import ColumnElement, UnaryExpression
from sqlalchemy.sql.operators import custom_op

from dex_tasks.states import CallStatus
from dex_tasks.store.connections import store_now
from dex_tasks.store.models import (
    ApprovalVoteRow,
    CallEventRow,
    CatalogRow,
    InterruptRow,
    KeyRow,
    MessageRow,
    ToolCallRow,
    TurnRow,
    WebhookRow,
)

log = logging.getLogger("dex_tasks.store")

CALLS = ToolCallRow.__table__  # type: ignore[attr-defined]
EVENTS = CallEventRow.__table__  # type: ignore[attr-defined]
INTERRUPTS = InterruptRow.__table__  # type: ignore[attr-defined]
CATALOG = CatalogRow.__table__  # type: ignore[attr-defined]
MESSAGES = MessageRow.__table__  # type: ignore[attr-defined]
TURNS = TurnRow.__table__  # type: ignore[attr-defined]
APPROVALS = ApprovalVoteRow.__table__  # type: ignore[attr-defined]
WEBHOOKS = WebhookRow.__table__  # type: ignore[attr-defined]
KEYS = KeyRow.__table__  # type: ignore[attr-defined]


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


# Statements on the hot path, built once: building one with .values(...) costs about half a
# millisecond of Python per call, as much as SQLite takes to run it. Values are bound.
INSERT_CALL = insert(CALLS)
INSERT_INTERRUPT = insert(INTERRUPTS)
INSERT_EVENT = insert(EVENTS)
# A terminal transition's event row, which also says whether the session has user messages
# waiting; most calls end with none, and then the delivery statement is not run at all.
INSERT_EVENT_QUEUED = INSERT_EVENT.returning(
    exists().where(MESSAGES.c.status == "queued",
                   MESSAGES.c.session_id == bindparam("queued_session")).label("queued"))
# The same for an ending that also records its attempt's start (a retrying call's, leased in
# Redis): both event rows in one statement, the start first (its id the lower); each returned
# row says the same. Bound as ``<column>_0`` and ``<column>_1``.
_EVENT_COLUMNS = ("session_id", "key", "event", "from_status", "to_status", "detail",
                  "created_at")
INSERT_EVENT_PAIR_QUEUED = insert(EVENTS).values(
    [{c: bindparam(f"{c}_{i}", type_=EVENTS.c[c].type) for c in _EVENT_COLUMNS}
     for i in (0, 1)]
).returning(exists().where(MESSAGES.c.status == "queued",
                           MESSAGES.c.session_id == bindparam("queued_session")).label("queued"))
INSERT_MESSAGE = insert(MESSAGES)
STORE_NOW = select(store_now())
# A pruned single-attempt call that ran leaves this event under its key (and no session, so no
# session's event stream lists it): ``prune.py`` writes it, a new call under the key is refused.
PRUNED_EVENT = "call_pruned"
PRUNED_SESSION = ""


def pruned_keys(keys: Any) -> Any:
    """The tombstones among ``keys`` (see :data:`PRUNED_EVENT`), a lookup of the key index."""
    return select(EVENTS.c.key).where(EVENTS.c.key.in_(keys), EVENTS.c.event == PRUNED_EVENT)

def bound(column: str, value: Any) -> Any:
    """``value`` as a typed bound parameter of ``column`` (NULL for None)."""
    return literal(value, CALLS.c[column].type) if value is not None else None


def equals(column: str, value: Any) -> ColumnElement[bool]:
    guard: ColumnElement[bool] = (CALLS.c[column].is_(None) if value is None
                                  else CALLS.c[column] == bound(column, value))
    return guard


# How a statement that finds its calls by key guards their status. Given ``key IN (...) AND
# status = ?``, SQLite (which keeps no statistics here) prefers a (status, ...) index and then
# reads every call in that status: a sweep rejecting 1,000 of 1M pending approvals took 16 s
# instead of 0.1 s. A unary "+" (SQLite's documented way to keep a term from choosing an index)
# leaves it the key's index. PostgreSQL plans from its statistics, and has no "+" for text.
_STATUS_BY_KEY = UnaryExpression(CALLS.c.status, operator=custom_op("+"),
                                 type_=CALLS.c.status.type)


def status_by_key(sqlite: bool) -> ColumnElement[Any]:
    return _STATUS_BY_KEY if sqlite else CALLS.c.status
