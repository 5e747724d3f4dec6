"""Durable turns: what ``DexClient.begin_turn``, ``record_step``, ``end_turn`` and
``open_turn`` check and run (the store's half is ``store/journal.py``).

An agent process is the least reliable part of a deployment: killed while its tool runs and
started again, it would ask the model again, get new tool-call ids, and run a non-idempotent
write a second time under a new key. A durable turn closes that hole:

1. ``begin_turn(session_id, input)`` opens the turn, or finds the one the killed process had
   open (same session, same input): ``Turn.resumed``, with its journaled ``steps``.
2. For its i-th model request an adapter replays ``turn.step(i).response`` if there is one;
   otherwise it asks the model and journals the response with ``record_step`` *before* any of
   its calls is sent: the assistant message and the calls in one transaction. Recording a step
   again (the replay) returns the same calls' records, so calls already made are awaited,
   never started again, and calls recorded but never sent are sent once.
3. ``end_turn`` records the model's answer without tools: the turn is over, and the user
   messages that waited for it are delivered after it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from dex_tasks.errors import InvalidArgumentError
from dex_tasks.limits import SESSION_ID_MAX, TURN_ID_MAX, check_id, check_text
from dex_tasks.registry import canonical_json
from dex_tasks.store import Store, journal, transcript
from dex_tasks.store.records import SessionMessage, Turn

# A step's position is an int; a turn of more steps than this is a loop gone wrong.
STEP_MAX = 10_000


def new_turn_id() -> str:
    """A fresh turn id, for a turn begun without one."""
    return f"turn-{uuid.uuid4().hex}"


def _check_ids(session_id: str, turn_id: str) -> None:
    check_id("session_id", session_id, SESSION_ID_MAX)
    check_id("turn_id", turn_id, TURN_ID_MAX, slash=False)


def _nonempty(field: str, value: object) -> str:
    text = check_text(field, value)
    if not text.strip():
        raise InvalidArgumentError(f"{field} must be a non-empty string")
    return text


def checked_response(response: object, field: str = "response") -> str:
    """``response`` as canonical JSON text; :class:`InvalidArgumentError` if it is no JSON."""
    text = check_text(field, response)
    try:
        return canonical_json(json.loads(text))
    except ValueError as err:
        raise InvalidArgumentError(f"{field} must be JSON text (the adapter's serialised model "
                                   f"response): {err}") from None


@dataclass(frozen=True)
class StepJournal:
    """One step to journal with its calls (``DexClient.record_step``): where it goes and what
    it holds, checked."""

    session_id: str
    turn_id: str
    step: int
    response: str
    text: str | None

    def stored(self, store: Store) -> dict[str, object] | None:
        """The step as already journaled, or None."""
        def read(conn: Connection) -> dict[str, object] | None:
            row = journal.get_step(conn, self.session_id, self.turn_id, self.step)
            return None if row is None else dict(row)

        return store.reading(read)

    def check_same(self, stored: dict[str, object], tool_calls: str) -> None:
        """:class:`~dex_tasks.TurnConflictError` unless ``stored`` is this step."""
        journal.check_same_step(stored, self.session_id, self.turn_id, self.step,
                                self.response, tool_calls)

    def writer(self, tool_calls: str) -> Callable[[Connection], None]:
        """What the calls' insert runs in its transaction: the step's assistant message."""
        def write(conn: Connection) -> None:
            journal.insert_step(conn, self.session_id, self.turn_id, self.step,
                                self.response, self.text, tool_calls, time.time())

        return write


def step_journal(session_id: str, turn_id: str, step: object, response: object,
                 text: object) -> StepJournal:
    """The checked step of ``record_step``; :class:`InvalidArgumentError` names what is wrong."""
    _check_ids(session_id, turn_id)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= STEP_MAX:
        raise InvalidArgumentError(f"step must be an int from 0 to {STEP_MAX} (the response's "
                                   f"position in the turn), got {step!r}")
    if text is not None:
        check_text("text", text)
    return StepJournal(session_id, turn_id, step, checked_response(response),
                       None if text is None else str(text))


def begin_turn(store: Store, session_id: str, input_text: str,
               turn_id: str | None = None) -> Turn:
    """See ``DexClient.begin_turn``."""
    turn_id = new_turn_id() if turn_id is None else turn_id
    _check_ids(session_id, turn_id)
    _nonempty("input_text", input_text)
    with store.write() as conn:
        return journal.begin_turn(conn, session_id, input_text, turn_id, time.time())


def end_turn(store: Store, session_id: str, turn_id: str, text: str,
             response: str | None = None) -> SessionMessage:
    """See ``DexClient.end_turn``."""
    _check_ids(session_id, turn_id)
    _nonempty("text", text)
    stored = None if response is None else checked_response(response)
    with store.write() as conn:
        message_id = journal.end_turn(conn, session_id, turn_id, text, stored, time.time())
        return journal.read_message(conn, message_id)


def open_turn(store: Store, session_id: str) -> Turn | None:
    """See ``DexClient.open_turn``."""
    check_id("session_id", session_id, SESSION_ID_MAX)
    return store.reading(lambda conn: journal.open_turn(conn, session_id))


def add_assistant_message(store: Store, session_id: str, turn_id: str,
                          text: str) -> SessionMessage:
    """The model's text of a turn: in a durable turn, its answer without tools (it ends the
    turn, :func:`end_turn`); in any other turn, a message of the transcript."""
    _check_ids(session_id, turn_id)
    if store.reading(lambda conn: journal.is_journaled(conn, session_id, turn_id)):
        return end_turn(store, session_id, turn_id, text)
    return transcript.add_assistant_message(store, session_id, turn_id, text)
