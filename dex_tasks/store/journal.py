"""Durable turns in the store: the turns table, and the model responses journaled as steps.

A turn (``dex_turns``) is begun by an input (the user message that began it, with its
``turn_id``), holds its session's later user messages queued while it is open, and ends when
the model answers without requesting tools (an assistant message; the queued messages are
delivered by the same transaction). Each model response of the turn that requested tools is a
*step*: an assistant message with the step's position (``step``), the response as the adapter
serialised it (``response``) and the calls it requested (``tool_calls``), inserted in the same
transaction as those calls (``DexClient.record_step``), so a restarted agent replays it and
its calls keep their keys.

Writers of one session's turn serialise on the session's message lock (PostgreSQL; SQLite's
writers are serialised anyway), so "is a turn open?" and the insert that follows cannot race.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, insert, or_, select, update
from sqlalchemy.engine import Connection

from dex_tasks.errors import InvalidArgumentError, TurnConflictError
from dex_tasks.states import MessageRole
from dex_tasks.store.delivery import deliver_ready_messages, lock_session_messages
from dex_tasks.store.records import SessionMessage, ToolCallRecord, Turn, TurnStep
from dex_tasks.store.sqljson import same_json
from dex_tasks.store.tables import CALLS, MESSAGES, TURNS
from dex_tasks.store.transcript import add_user_message

OPEN = "open"
ENDED = "ended"

_INSERT_MESSAGE = insert(MESSAGES).returning(MESSAGES.c.id)
_TURN = select(TURNS).where(TURNS.c.session_id == bindparam("t_session"),
                            TURNS.c.turn_id == bindparam("t_turn"))
_OPEN_TURN = (select(TURNS).where(TURNS.c.status == OPEN,
                                  TURNS.c.session_id == bindparam("t_session"))
              .order_by(TURNS.c.created_at).limit(1))
_TURN_MESSAGES = (select(MESSAGES)
                  .where(MESSAGES.c.session_id == bindparam("t_session"),
                         MESSAGES.c.turn_id == bindparam("t_turn"),
                         MESSAGES.c.role == MessageRole.ASSISTANT.value)
                  .order_by(MESSAGES.c.id))
_TURN_CALLS = select(CALLS).where(CALLS.c.session_id == bindparam("t_session"),
                                  CALLS.c.turn_id == bindparam("t_turn"))
_STEP = select(MESSAGES).where(MESSAGES.c.session_id == bindparam("t_session"),
                               MESSAGES.c.turn_id == bindparam("t_turn"),
                               MESSAGES.c.step == bindparam("t_step"))


def _dt(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)


def turn_key(session_id: str, turn_id: str, step: int | None = None) -> str:
    """How errors and logs name a turn (``session/turn``) or one of its steps (``...#step``)."""
    return f"{session_id}/{turn_id}" + ("" if step is None else f"#{step}")


def step_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """The ``tool_calls`` column of a step: each call's id, tool and (canonical) arguments."""
    return json.dumps([{"tool_call_id": c["tool_call_id"], "tool": c["tool"],
                        "arguments": c["arguments"]} for c in calls], sort_keys=True)


# -- reading ------------------------------------------------------------------------------------


def _turn_view(conn: Connection, row: Mapping[str, Any], **flags: bool) -> Turn:
    """The turn with its steps, each with its calls, and its answer: read in ``conn``'s
    transaction (so the three statements see one state of the store)."""
    params = {"t_session": row["session_id"], "t_turn": row["turn_id"]}
    messages = conn.execute(_TURN_MESSAGES, params).mappings().all()
    calls = {c["tool_call_id"]: ToolCallRecord.from_mapping(dict(c))
             for c in conn.execute(_TURN_CALLS, params).mappings()}
    steps: list[TurnStep] = []
    answer: str | None = None
    for message in messages:
        if message["step"] is None:
            answer = message["text"]  # the model's answer without tools (or earlier text)
            continue
        requested = json.loads(message["tool_calls"]) if message["tool_calls"] else []
        steps.append(TurnStep(
            step=message["step"], response=message["response"] or "null",
            text=message["text"],
            calls=[calls[c["tool_call_id"]] for c in requested if c["tool_call_id"] in calls],
            created_at=_dt(message["created_at"]),
        ))
    steps.sort(key=lambda s: s.step)
    return Turn(session_id=row["session_id"], turn_id=row["turn_id"], input=row["input"],
                status=row["status"], steps=steps,
                answer=answer if row["status"] == ENDED else None,
                created_at=_dt(row["created_at"]), ended_at=_dt(row["ended_at"]), **flags)


def open_turn(conn: Connection, session_id: str) -> Turn | None:
    """The session's open turn (the oldest, should there be several), or None."""
    row = conn.execute(_OPEN_TURN, {"t_session": session_id}).mappings().first()
    return None if row is None else _turn_view(conn, dict(row))


def get_turn(conn: Connection, session_id: str, turn_id: str) -> Turn | None:
    """The turn, open or ended, or None if it was never begun."""
    row = conn.execute(_TURN, {"t_session": session_id, "t_turn": turn_id}).mappings().first()
    return None if row is None else _turn_view(conn, dict(row))


def get_step(conn: Connection, session_id: str, turn_id: str,
             step: int) -> Mapping[str, Any] | None:
    """The assistant message that journals step ``step`` of the turn, or None."""
    row = conn.execute(_STEP, {"t_session": session_id, "t_turn": turn_id,
                               "t_step": step}).mappings().first()
    return None if row is None else dict(row)


def check_same_step(stored: Mapping[str, Any], session_id: str, turn_id: str, step: int,
                    response: str, tool_calls: str) -> None:
    """:class:`TurnConflictError` unless the journaled step holds this response and these
    calls (compared by value: PostgreSQL's jsonb hands back its own spelling)."""
    where = turn_key(session_id, turn_id, step)
    if not same_json(stored["response"] or "null", response):
        raise TurnConflictError(where, "model response")
    if not same_json(stored["tool_calls"] or "[]", tool_calls):
        raise TurnConflictError(where, "list of tool calls")


# -- writing ------------------------------------------------------------------------------------


def begin_turn(conn: Connection, session_id: str, input_text: str, turn_id: str,
               now: float) -> Turn:
    """Begin turn ``turn_id`` with ``input_text``, or find the session's open turn.

    * the session has an open turn with this input (or this turn id with this input): that
      turn, ``resumed`` (its steps included): the agent process restarted;
    * an open turn with another input: the input is queued as a user message (once: a queued
      message of the same text, or one delivered that no turn has begun with yet, is not
      stored again) for after that turn, which is returned with ``queued_input``;
    * ``turn_id`` names a turn that ended: that turn (its ``answer`` included);
    * otherwise a new open turn. Its input is the user message that begins it: the message
      that waited for an earlier turn with this text (queued, then delivered when that turn
      ended), if one has begun no turn yet, so that running the same code again with the
      input that was queued answers that message instead of storing it twice; else a new one.
    """
    lock_session_messages(conn, session_id)
    current = open_turn(conn, session_id)
    if current is not None:
        if current.turn_id == turn_id and current.input != input_text:
            raise TurnConflictError(turn_key(session_id, turn_id), "input",
                                    f"the turn began with {current.input!r}")
        if current.input == input_text or current.turn_id == turn_id:
            return current.model_copy(update={"resumed": True})
        if _waiting_input(conn, session_id, input_text, delivered=False) is None:
            add_user_message(conn, session_id, input_text, now)
        return current.model_copy(update={"queued_input": True})
    ended = get_turn(conn, session_id, turn_id)
    if ended is not None:
        if ended.input != input_text:
            raise TurnConflictError(turn_key(session_id, turn_id), "input",
                                    f"the turn began with {ended.input!r}")
        return ended
    conn.execute(insert(TURNS), {"session_id": session_id, "turn_id": turn_id,
                                 "input": input_text, "status": OPEN, "created_at": now,
                                 "ended_at": None})
    waited = _waiting_input(conn, session_id, input_text, delivered=True)
    if waited is not None:
        conn.execute(update(MESSAGES).where(MESSAGES.c.id == waited)
                     .values(turn_id=turn_id))
    else:
        conn.execute(_INSERT_MESSAGE, {"session_id": session_id,
                                       "role": MessageRole.USER.value, "text": input_text,
                                       "turn_id": turn_id, "status": "delivered",
                                       "created_at": now, "delivered_at": now})
    return Turn(session_id=session_id, turn_id=turn_id, input=input_text, status=OPEN,
                created_at=_dt(now))


def _waiting_input(conn: Connection, session_id: str, text: str, *,
                   delivered: bool) -> int | None:
    """The oldest user message of this text that waited for a turn to end and has begun no
    turn: one delivered (``follows`` says it waited), or with ``delivered=False`` one still
    queued as well. Its id, or None."""
    waited = MESSAGES.c.follows.is_not(None)
    found = conn.execute(select(MESSAGES.c.id).where(
        MESSAGES.c.session_id == session_id, MESSAGES.c.role == MessageRole.USER.value,
        MESSAGES.c.text == text, MESSAGES.c.turn_id.is_(None),
        waited if delivered else or_(waited, MESSAGES.c.status == "queued"),
    ).order_by(MESSAGES.c.id).limit(1)).first()
    return None if found is None else int(found.id)


def _ensure_open(conn: Connection, session_id: str, turn_id: str, now: float) -> None:
    """The turn is open: begun here if it was not (a step may begin its turn, as a turn an
    adapter names without ``begin_turn``); :class:`TurnConflictError` if it has ended."""
    row = conn.execute(_TURN, {"t_session": session_id, "t_turn": turn_id}).mappings().first()
    if row is None:
        conn.execute(insert(TURNS), {"session_id": session_id, "turn_id": turn_id,
                                     "input": None, "status": OPEN, "created_at": now,
                                     "ended_at": None})
    elif row["status"] != OPEN:
        raise TurnConflictError(turn_key(session_id, turn_id), "status",
                                "the turn has ended, so no step can be added to it")


def insert_step(conn: Connection, session_id: str, turn_id: str, step: int, response: str,
                text: str | None, tool_calls: str, now: float) -> None:
    """Journal step ``step`` of the turn in the caller's transaction (the one inserting its
    calls). The step must be the turn's next one; a concurrent insert of the same step fails
    on the unique index (``IntegrityError``), and the caller reads the winner's."""
    lock_session_messages(conn, session_id)
    taken = conn.execute(select(MESSAGES.c.step).where(
        MESSAGES.c.session_id == session_id, MESSAGES.c.turn_id == turn_id,
        MESSAGES.c.step.is_not(None))).scalars().all()
    if step not in taken:  # (a step taken: the insert below fails on the index, see above)
        _ensure_open(conn, session_id, turn_id, now)
    if step != len(taken) and step not in taken:
        raise InvalidArgumentError(
            f"step {step} of turn {turn_key(session_id, turn_id)!r} cannot be journaled: the "
            f"turn has {len(taken)} step(s), so the next one is step {len(taken)}")
    conn.execute(_INSERT_MESSAGE, {"session_id": session_id,
                                   "role": MessageRole.ASSISTANT.value, "text": text,
                                   "turn_id": turn_id, "step": step, "response": response,
                                   "tool_calls": tool_calls, "created_at": now})


def end_turn(conn: Connection, session_id: str, turn_id: str, text: str,
             response: str | None, now: float) -> int:
    """End the turn with the model's answer (an assistant message) and deliver the session's
    queued user messages after it; returns the answer's message id.

    Idempotent: a turn that ended with this answer returns that message; with another answer,
    :class:`TurnConflictError`. A turn never begun is recorded as begun and ended here.
    """
    lock_session_messages(conn, session_id)
    row = conn.execute(_TURN, {"t_session": session_id, "t_turn": turn_id}).mappings().first()
    if row is not None and row["status"] == ENDED:
        last = conn.execute(
            select(MESSAGES.c.id, MESSAGES.c.text)
            .where(MESSAGES.c.session_id == session_id, MESSAGES.c.turn_id == turn_id,
                   MESSAGES.c.role == MessageRole.ASSISTANT.value, MESSAGES.c.step.is_(None))
            .order_by(MESSAGES.c.id.desc()).limit(1)).first()
        if last is not None and last.text == text:
            return int(last.id)
        raise TurnConflictError(turn_key(session_id, turn_id), "answer",
                                "the turn has ended already")
    if row is None:
        conn.execute(insert(TURNS), {"session_id": session_id, "turn_id": turn_id,
                                     "input": None, "status": ENDED, "created_at": now,
                                     "ended_at": now})
    else:
        conn.execute(update(TURNS).where(TURNS.c.session_id == session_id,
                                         TURNS.c.turn_id == turn_id, TURNS.c.status == OPEN)
                     .values(status=ENDED, ended_at=now))
    message_id = int(conn.execute(_INSERT_MESSAGE, {
        "session_id": session_id, "role": MessageRole.ASSISTANT.value, "text": text,
        "turn_id": turn_id, "response": response, "created_at": now}).scalar_one())
    deliver_ready_messages(conn, now, session_id, locked=True)
    return message_id


def is_journaled(conn: Connection, session_id: str, turn_id: str) -> bool:
    """True if the turn was begun as a durable turn (``begin_turn`` or a journaled step)."""
    row = conn.execute(_TURN, {"t_session": session_id, "t_turn": turn_id}).first()
    return row is not None


def read_message(conn: Connection, message_id: int) -> SessionMessage:
    """One transcript message by id, in the caller's transaction."""
    row = conn.execute(select(MESSAGES).where(MESSAGES.c.id == message_id)).mappings().one()
    return SessionMessage.from_row(dict(row))


__all__ = ["ENDED", "OPEN", "begin_turn", "check_same_step", "end_turn", "get_step",
           "get_turn", "insert_step", "is_journaled", "open_turn", "read_message",
           "step_calls", "turn_key"]
