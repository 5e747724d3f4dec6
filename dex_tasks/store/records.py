"""What users see: read-only views built from store rows."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, computed_field

from dex_tasks.arguments import arguments_version
from dex_tasks.policy import EffectClass
from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store.models import CallEventRow, ToolCallRow


def _dt(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)


class ToolCallRecord(BaseModel):
    """One tool call as the agent (and the model) sees it."""

    key: str
    session_id: str
    turn_id: str
    tool_call_id: str
    tool: str
    arguments: dict[str, Any]
    effect: EffectClass
    requires_approval: bool
    status: CallStatus
    result: Any = None
    error: str | None = None
    attempts: int = 0
    max_attempts: int = 1
    interrupt_id: str | None = None
    created_at: datetime
    finished_at: datetime | None = None
    original_arguments: dict[str, Any] | None = None
    """The arguments the model asked for, when a person approved edited ones (``arguments``
    are then those, which the tool ran with); None otherwise."""
    approval_rule: dict[str, Any] | None = None
    """The policy snapshot of a rule on the arguments: ``rule``, ``required``, ``reason`` and
    ``error`` (set when the rule could not be evaluated and the call waited for a person)."""

    @property
    def terminal(self) -> bool:
        """True once the call has ended; it never changes after that."""
        return self.status.terminal

    @property
    def arguments_edit(self) -> str | None:
        """What the model is told when a person approved edited arguments: which fields
        changed, from what to what. None when the arguments were not edited."""
        if self.original_arguments is None:
            return None
        return edit_note(self.original_arguments, self.arguments)

    @classmethod
    def from_row(cls, row: ToolCallRow) -> ToolCallRecord:
        """Build the view from a store row."""
        return cls.from_mapping({name: getattr(row, name, None) for name in RECORD_COLUMNS})

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any]) -> ToolCallRecord:
        """Build the view from the columns of a call as read (``Store.get_call_columns``):
        what ``get_tool_call`` and ``wait`` return, without building a ``ToolCallRow``
        first (its validation cost more than the read itself: ``python -m bench pgindex``'s
        notes in docs/performance.md)."""
        return cls(
            key=row["key"],
            session_id=row["session_id"],
            turn_id=row["turn_id"],
            tool_call_id=row["tool_call_id"],
            tool=row["tool"],
            arguments=json.loads(row["arguments"]),
            effect=EffectClass(row["effect"]),
            requires_approval=row["requires_approval"],
            status=CallStatus(row["status"]),
            result=_json_or_none(row["result"]),
            error=row["error"],
            attempts=row["attempts"],
            max_attempts=row["max_attempts"],
            interrupt_id=row["interrupt_id"],
            created_at=_dt(row["created_at"]),
            finished_at=_dt(row["finished_at"]),
            original_arguments=_json_or_none(row.get("original_arguments")),
            approval_rule=_json_or_none(row.get("approval_rule")),
        )


RECORD_COLUMNS = ("key", "session_id", "turn_id", "tool_call_id", "tool", "arguments", "effect",
                  "requires_approval", "status", "result", "error", "attempts", "max_attempts",
                  "interrupt_id", "created_at", "finished_at", "original_arguments",
                  "approval_rule")
"""The columns of a call that its record shows: what :meth:`ToolCallRecord.from_mapping`
reads, and what the ended record handed to waiters holds (``EndedCall.record``)."""


def _json_or_none(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def edit_note(original: Mapping[str, Any], edited: Mapping[str, Any]) -> str:
    """``the arguments were edited before approval: amount_cents 50000 -> 20000`` (each
    changed, added or removed field, in name order)."""
    changes = []
    for name in sorted(set(original) | set(edited)):
        before, after = original.get(name, _ABSENT), edited.get(name, _ABSENT)
        if before == after:
            continue
        changes.append(f"{name} {_shown(before)} -> {_shown(after)}")
    return ("the arguments were edited before approval: " + "; ".join(changes)
            if changes else "the arguments were approved unchanged")


_ABSENT = object()


def _shown(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, sort_keys=True)


class CallEvent(BaseModel):
    """One transition in a session's event stream; ``id`` is the cursor."""

    id: int
    session_id: str
    key: str
    event: str
    from_status: CallStatus | None = None
    to_status: CallStatus
    detail: dict[str, Any] | None = None
    created_at: datetime

    @classmethod
    def from_row(cls, row: CallEventRow) -> CallEvent:
        """Build the view from a store row."""
        return cls(
            id=row.id or 0,
            session_id=row.session_id,
            key=row.key,
            event=row.event,
            from_status=CallStatus(row.from_status) if row.from_status else None,
            to_status=CallStatus(row.to_status),
            detail=json.loads(row.detail) if row.detail else None,
            created_at=_dt(row.created_at),
        )


class PendingInterrupt(BaseModel):
    """A call waiting for a person's decision (its deadline, if any, not yet passed)."""

    interrupt_id: str
    session_id: str
    key: str
    tool: str
    arguments: dict[str, Any]
    effect: EffectClass
    deadline: datetime | None = None
    created_at: datetime
    approvals_required: int = 1
    """How many distinct approvals decide it (the first rejection decides at once)."""
    approved_by: list[str] = []
    """Who approved so far, in order (when several approvals are needed)."""
    approver_permission: str | None = None
    """The permission an approver's token must hold, if the policy names one."""
    original_arguments: dict[str, Any] | None = None
    """The model's arguments when a person edited them while more approvals are needed
    (``arguments`` are the edited version, which the approvals are for)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def arguments_version(self) -> str:
        """The id of the version of ``arguments`` shown here; an approval names it
        (``resolve_interrupt(arguments_version=...)``) so it approves what was seen."""
        return arguments_version(self.arguments)


class Decision(BaseModel):
    """The audit record of one decided approval: who, when, what, why, and how the call ended.

    ``decision`` is ``approved``, ``rejected`` (by a person) or ``expired`` (the deadline passed;
    ``decided_by`` is then None). ``call_status`` is the call's status now.
    """

    interrupt_id: str
    key: str
    tool: str
    arguments: dict[str, Any]
    effect: EffectClass
    decision: Literal["approved", "rejected", "expired"]
    decided_by: str | None = None
    decided_at: datetime
    reason: str | None = None
    deadline: datetime | None = None
    call_status: CallStatus
    approved_by: list[str] = []
    """Every approver, in order, when several approvals were needed."""
    original_arguments: dict[str, Any] | None = None
    """The model's arguments when the approval edited them (``arguments`` are the edited)."""


class SessionMessage(BaseModel):
    """One message of a session's transcript, which the model reads (oldest first).

    ``role`` says whose it is. A user message (``MessageRole.USER``) has ``text`` and a
    ``status``: ``queued`` while a turn of the session that had begun when it was sent is open,
    then ``delivered``. An assistant message (``ASSISTANT``) has ``text`` and ``turn_id``. A
    tool message (``TOOL``) is written in the transaction that ends its call; ``text`` is None
    and it has the call's ``turn_id``, ``tool_call_id``, ``tool``, ``key``, ``call_status``,
    ``tool_arguments`` (the arguments as JSON text) and ``tool_output``: the result as JSON
    text if the call succeeded, its error text otherwise (so an unknown outcome's contains
    ``OUTCOME_UNKNOWN_TOOL_RESULT``). A tool message's ``text`` is None, except when a person
    approved edited arguments: then it is the edit note the model reads
    (``the arguments were edited before approval: ...``; ``dex_tasks.tool_message_text``
    renders the message as the model reads it).
    """

    id: int
    session_id: str
    role: MessageRole
    text: str | None = None
    created_at: datetime
    status: Literal["queued", "delivered"] | None = None
    delivered_at: datetime | None = None
    turn_id: str | None = None
    tool_call_id: str | None = None
    tool: str | None = None
    key: str | None = None
    call_status: CallStatus | None = None
    tool_arguments: str | None = None
    tool_output: str | None = None
    step: int | None = None
    """On an assistant message that journals a model response of a durable turn: its position
    in the turn (0 first); ``tool_calls`` are the calls that response requested, each a dict
    with ``tool_call_id``, ``tool`` and ``arguments``."""
    tool_calls: list[dict[str, Any]] | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SessionMessage:
        """Build the view from a ``dex_messages`` row (as a mapping)."""
        return cls(
            id=row["id"], session_id=row["session_id"], role=MessageRole(row["role"]),
            text=row["text"], created_at=_dt(row["created_at"]), status=row["status"],
            delivered_at=_dt(row["delivered_at"]), turn_id=row["turn_id"],
            tool_call_id=row["tool_call_id"], tool=row["tool"], key=row["key"],
            call_status=CallStatus(row["call_status"]) if row["call_status"] else None,
            tool_arguments=row["tool_arguments"], tool_output=row["tool_output"],
            step=row.get("step"),
            tool_calls=json.loads(row["tool_calls"]) if row.get("tool_calls") else None,
        )


class AgentSnapshot(BaseModel):
    """A session as it stands: its tool calls, its transcript (``messages``: user, assistant
    and tool messages, oldest first), pending approvals and decided ones."""

    session_id: str
    tool_calls: list[ToolCallRecord]
    messages: list[SessionMessage] = []
    pending_interrupts: list[PendingInterrupt] = []
    decided: list[Decision] = []


class TurnStep(BaseModel):
    """One journaled step of a durable turn: a model response and the calls it requested.

    ``step`` is its position in the turn (0 first); ``response`` the model response as the
    adapter serialised it (JSON text), replayed instead of asking the model again; ``text``
    the model's text in it, if any; ``calls`` the records of its tool calls, in the order the
    response requested them (recorded in the same transaction as the step).
    """

    step: int
    response: str
    text: str | None = None
    calls: list[ToolCallRecord] = []
    created_at: datetime


class Turn(BaseModel):
    """A turn of a session as a durable flow (``DexClient.begin_turn``, ``open_turn``).

    ``status`` is ``open`` until the model answers without tools (``end_turn``), then
    ``ended``, with the answer in ``answer``. ``steps`` are the journaled model responses,
    step 0 first; an adapter replays ``steps[i]`` for its i-th model request instead of asking
    the model. ``resumed`` is True when ``begin_turn`` found this turn open already (the agent
    process restarted); ``queued_input`` when ``begin_turn`` was given another input, which
    was queued as a user message for after this turn.
    """

    session_id: str
    turn_id: str
    input: str | None = None
    status: Literal["open", "ended"]
    steps: list[TurnStep] = []
    answer: str | None = None
    resumed: bool = False
    queued_input: bool = False
    created_at: datetime
    ended_at: datetime | None = None

    @property
    def open(self) -> bool:
        """True while the model has not answered without tools."""
        return self.status == "open"

    @property
    def next_step(self) -> int:
        """The position of the next model response of this turn."""
        return len(self.steps)

    def step(self, position: int) -> TurnStep | None:
        """The journaled step at ``position``, or None if the model has not answered it yet."""
        return self.steps[position] if 0 <= position < len(self.steps) else None
