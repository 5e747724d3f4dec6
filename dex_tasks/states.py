"""The call state machine (statuses and the moves between them) and the roles of a session's
transcript messages. Pure data, no I/O."""

from __future__ import annotations

from enum import Enum


class CallStatus(str, Enum):
    """Where a tool call is in its life. Terminal statuses never change again."""

    AWAITING_APPROVAL = "awaiting_approval"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    OUTCOME_UNKNOWN = "outcome_unknown"

    @property
    def terminal(self) -> bool:
        """True for the four statuses a call ends in."""
        return self in TERMINAL


TERMINAL = frozenset(
    {CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.REJECTED, CallStatus.OUTCOME_UNKNOWN}
)

# For each target status, the statuses a call may move to it from. Everything else is refused.
ALLOWED_FROM: dict[CallStatus, frozenset[CallStatus]] = {
    CallStatus.QUEUED: frozenset({CallStatus.AWAITING_APPROVAL, CallStatus.RUNNING}),
    CallStatus.RUNNING: frozenset({CallStatus.QUEUED}),
    # queued -> succeeded: a retrying call, whose running attempt is a lease in Redis (v4).
    CallStatus.SUCCEEDED: frozenset({CallStatus.RUNNING, CallStatus.QUEUED}),
    # queued -> failed only for "the tool did not run"; running -> failed for tool errors.
    CallStatus.FAILED: frozenset({CallStatus.QUEUED, CallStatus.RUNNING}),
    CallStatus.REJECTED: frozenset({CallStatus.AWAITING_APPROVAL}),
    # queued -> outcome_unknown: an idempotent write whose attempts ran out after worker losses.
    CallStatus.OUTCOME_UNKNOWN: frozenset({CallStatus.RUNNING, CallStatus.QUEUED}),
    CallStatus.AWAITING_APPROVAL: frozenset(),
}

OUTCOME_UNKNOWN_TOOL_RESULT = "OUTCOME_UNKNOWN_TOOL_RESULT"
"""Prefix of the error of every ``outcome_unknown`` call."""

TOOL_DID_NOT_RUN = "the tool did not run, so it is safe to call again"
"""Prefix of the error of every ``failed`` call that no attempt reached the tool for."""


class MessageRole(str, Enum):
    """Who a message of a session's transcript comes from (``SessionMessage.role``)."""

    USER = "user"
    """A user message (``send_user_message``), reports of unknown outcomes included."""
    TOOL = "tool"
    """A tool call's result, written in the transaction that ended the call."""
    ASSISTANT = "assistant"
    """The model's own text, recorded by the agent process (``add_assistant_message``)."""
