"""A session's transcript: user messages, the model's own text, and the tool messages.

Everything is one table, ``dex_messages``, read oldest first (``session_snapshot``):

* tool messages are written by ``Store.transition``, in the transaction that ends their call;
* user messages (:func:`send_user_message`) are stored ``queued`` while a turn of the session is
  open and delivered by the transaction that ends the turn's last call
  (``store.deliver_ready_messages``, called by every terminal transition); the
  ``deliver_messages`` sweep is a safety net;
* assistant messages (:func:`add_assistant_message`) are the model's text, which the agent
  process records so that the transcript is the whole conversation.

The transcript is rendered here for every reader (``session_snapshot``, ``DexClient``, the HTTP
API, the page): the tool message of a call a person approved with edited arguments has the
edit note as its ``text`` (``the arguments were edited before approval: amount_cents 50000 ->
9000``), from the call's ``original_arguments`` (one small query per transcript read: the
session's edited calls). :func:`tool_message_text` is what the
model reads for a call, note first; every framework adapter gives the model that.

One rule about reports of unknown outcomes lives here, because every reconciler (the seeds'
sample, :func:`dex_tasks.agent.reconcile.report_unknown_outcomes`, beat's per-tool checkers) writes
its report with :func:`send_user_message`: a user message whose text ends in
``(tool call <key>)``, naming an ``outcome_unknown`` call of the session, is a report of that
call, and it is stored only if no user message of the session names the key yet. The check and
the insert run in one write transaction under a per-session lock, so reconcilers that race
still leave one report.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import bindparam, insert, literal, select
from sqlalchemy.engine import Connection

from dex_tasks.errors import DexError, InvalidArgumentError
from dex_tasks.limits import SESSION_ID_MAX, TURN_ID_MAX, check_id, check_text
from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store import (
    CALLS,
    MESSAGES,
    Store,
    deliver_ready_messages,
    lock_session_messages,
)
from dex_tasks.store.records import SessionMessage, ToolCallRecord, edit_note

log = logging.getLogger("dex_tasks.store.transcript")

REPORT_MARKER = "(tool call "
"""A report of an unknown outcome ends with ``(tool call <key>)``."""

QUEUED = "queued"
DELIVERED = "delivered"

# LIKE's escape character: not a backslash, which PostgreSQL and SQLite quote differently.
_ESCAPE = "!"
# Characters that may continue an id: a key "names" a call only where the text has none of
# them right before or after it, so "s/t1/c1" is not named by a report of "s/t1/c10".
_ID_CHAR = r"[\w/-]"


def report_text(key: str, answer: str) -> str:
    """The text of a report: the checker's answer, then ``(tool call <key>)``."""
    return f"{answer.strip()} {REPORT_MARKER}{key})"


def report_key(text: str) -> str | None:
    """The key a report names (``... (tool call <key>)`` at the end of ``text``), or None."""
    stripped = text.rstrip()
    at = stripped.rfind(REPORT_MARKER)
    if at < 0 or not stripped.endswith(")"):
        return None
    return stripped[at + len(REPORT_MARKER):-1] or None


def names_key(text: str | None, key: str) -> bool:
    """True if ``text`` contains ``key`` as a whole (not as part of a longer id)."""
    if not text or key not in text:
        return False
    return re.search(rf"(?<!{_ID_CHAR}){re.escape(key)}(?!{_ID_CHAR})", text) is not None


def like_pattern(key: str) -> str:
    """A LIKE pattern (with ``ESCAPE '!'``) matching any text that contains ``key``."""
    escaped = key.replace(_ESCAPE, _ESCAPE * 2).replace("%", "!%").replace("_", "!_")
    return f"%{escaped}%"


# The user messages of a session that may name a key: LIKE narrows them (it ignores case on
# SQLite, so it may keep too many); names_key decides.
_MAY_NAME = select(MESSAGES.c.text).where(
    MESSAGES.c.session_id == bindparam("name_session"),
    MESSAGES.c.role == MessageRole.USER.value,
    MESSAGES.c.text.like(bindparam("name_pattern"), escape=_ESCAPE),
)
_UNKNOWN_CALL = select(literal(1)).where(
    CALLS.c.key == bindparam("unknown_key"),
    CALLS.c.session_id == bindparam("unknown_session"),
    CALLS.c.status == CallStatus.OUTCOME_UNKNOWN.value,
)
_INSERT = insert(MESSAGES).returning(MESSAGES.c.id)


def key_named(conn: Connection, session_id: str, key: str) -> bool:
    """True if a user message of the session already names ``key``."""
    texts = conn.execute(_MAY_NAME, {"name_session": session_id,
                                     "name_pattern": like_pattern(key)}).scalars()
    return any(names_key(text, key) for text in texts)


def named_keys(conn: Connection, calls: Iterable[tuple[str, str]]) -> set[str]:
    """Of the ``(session_id, key)`` pairs, the keys a user message of their session names."""
    return {key for session_id, key in calls if key_named(conn, session_id, key)}


# -- writing ------------------------------------------------------------------------------------


def _require_text(field: str, value: Any) -> str:
    if not check_text(field, value):
        raise InvalidArgumentError(f"{field} must be a non-empty string")
    return str(value)


def add_user_message(conn: Connection, session_id: str, text: str, now: float) -> int | None:
    """Insert a user message in the caller's transaction; its id, or None if it was refused.

    Refused only when it reports an unknown outcome (see the module docstring) that a user
    message of the session already names. Delivered at once if no turn holds it.
    """
    key = report_key(text)
    if key is not None and key.startswith(f"{session_id}/"):
        # Before the check: a racing report of the same call waits here until we commit,
        # and its check then sees our message.
        lock_session_messages(conn, session_id)
        reports_unknown = conn.execute(
            _UNKNOWN_CALL, {"unknown_key": key, "unknown_session": session_id}).first()
        if reports_unknown is not None and key_named(conn, session_id, key):
            log.info("report of an already reported call not stored",
                     extra={"action": "report_duplicate", "session_id": session_id,
                            "key": key})
            return None
    message_id = int(conn.execute(_INSERT, {
        "session_id": session_id, "role": MessageRole.USER.value, "text": text,
        "status": QUEUED, "created_at": now,
    }).scalar_one())
    deliver_ready_messages(conn, now, session_id)
    return message_id


def send_user_message(
    store: Store, session_id: str, text: str, now: float | None = None
) -> SessionMessage | None:
    """Store a user message; the message (``delivered`` at once unless a turn of the session is
    open), or None if it was a report of an unknown outcome that the session already has."""
    check_id("session_id", session_id, SESSION_ID_MAX)
    _require_text("text", text)
    now = time.time() if now is None else now
    with store.write() as conn:
        message_id = add_user_message(conn, session_id, text, now)
        if message_id is None:
            return None
        message = _read_one(conn, message_id)
    log.info("user message stored", extra={"action": "user_message", "session_id": session_id,
                                           "message_id": message.id, "status": message.status})
    return message


def add_assistant_message(
    store: Store, session_id: str, turn_id: str, text: str, now: float | None = None
) -> SessionMessage:
    """Record the model's own text of turn ``turn_id`` in the session's transcript."""
    check_id("session_id", session_id, SESSION_ID_MAX)
    check_id("turn_id", turn_id, TURN_ID_MAX, slash=False)
    _require_text("text", text)
    now = time.time() if now is None else now
    with store.write() as conn:
        message_id = int(conn.execute(_INSERT, {
            "session_id": session_id, "role": MessageRole.ASSISTANT.value, "text": text,
            "turn_id": turn_id, "created_at": now,
        }).scalar_one())
        return _read_one(conn, message_id)


def deliver_messages(store: Store, now: float | None = None) -> int:
    """Deliver every queued message whose turn is over (the sweep's safety net)."""
    now = time.time() if now is None else now
    with store.write() as conn:
        return deliver_ready_messages(conn, now)


# -- reading ------------------------------------------------------------------------------------


def _read_one(conn: Connection, message_id: int) -> SessionMessage:
    row = conn.execute(select(MESSAGES).where(MESSAGES.c.id == message_id)).mappings().one()
    return SessionMessage.from_row(dict(row))


# The calls of a session a person approved with edited arguments: usually none, read by the
# session index, so rendering a transcript costs one small query, not a join per message.
_EDITED_CALLS = select(CALLS.c.key, CALLS.c.original_arguments).where(
    CALLS.c.session_id == bindparam("e_session"), CALLS.c.original_arguments.is_not(None))


def with_edit_notes(conn: Connection, session_id: str,
                    messages: list[SessionMessage]) -> list[SessionMessage]:
    """The messages as the transcript shows them: the tool message of a call approved with
    edited arguments has the edit note as its text."""
    if not any(m.role is MessageRole.TOOL for m in messages):
        return messages
    originals: dict[str, str] = {
        row.key: row.original_arguments
        for row in conn.execute(_EDITED_CALLS, {"e_session": session_id})}
    if not originals:
        return messages
    return [_noted(m, originals.get(m.key)) if m.role is MessageRole.TOOL and m.key else m
            for m in messages]


def _noted(message: SessionMessage, original: str | None) -> SessionMessage:
    if original is None or message.tool_arguments is None:
        return message
    note = edit_note(json.loads(original), json.loads(message.tool_arguments))
    return message.model_copy(update={"text": note})


def session_messages(conn: Connection, session_id: str) -> list[SessionMessage]:
    """The session's transcript, oldest first, read in the caller's transaction.

    In the order the model reads it: by id, except that a user message which waited for its
    turn to end sits right after the message that ended it (``follows``). One still waiting
    (``queued``) is shown where it was sent.
    """
    rows = conn.execute(
        select(MESSAGES).where(MESSAGES.c.session_id == session_id).order_by(MESSAGES.c.id)
    ).mappings().all()
    return with_edit_notes(conn, session_id, [SessionMessage.from_row(dict(row))
                                              for row in sorted(rows, key=transcript_order)])


def tool_message_text(call: ToolCallRecord | SessionMessage, output: str | None = None) -> str:
    """What the model reads for an ended call (a record, or its tool message): ``output``
    (default: the result as JSON text, or the error text), after the edit note in parentheses
    on a line of its own when a person approved edited arguments, so the model knows that the
    tool ran with other arguments than it asked for."""
    if isinstance(call, SessionMessage):
        note = call.text
        if output is None:
            status = call.call_status.value if call.call_status else "unknown"
            output = call.tool_output or f"the tool call ended {status}"
    else:
        note = call.arguments_edit
        if output is None:
            output = (json.dumps(call.result, ensure_ascii=False)
                      if call.status is CallStatus.SUCCEEDED
                      else call.error or f"the tool call ended {call.status.value}")
    return f"({note})\n{output}" if note else output


def transcript_order(row: Any) -> tuple[int, bool, int]:
    """Sort key of a message row in its session's transcript (see :func:`session_messages`)."""
    follows = row["follows"]
    return (row["id"] if follows is None else follows, follows is not None, row["id"])


class InvalidCheckResultError(DexError):
    """A checker returned something other than a text or None."""


def checked_answer(value: object) -> str | None:
    """A checker's answer as report text; None (not known yet) for None or blank text."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCheckResultError(
            f"a reconciliation check must return a str or None, got {type(value).__name__}"
        )
    return value if value.strip() else None
