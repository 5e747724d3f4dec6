"""From a tool-call request to a new call's row: ids, arguments, policy snapshot, approval.

Shared by ``DexClient.call_tool`` (one call) and ``DexClient.call_tools`` (a turn's calls at
once), so both refuse the same input with the same errors and store the same rows. Nothing
here writes or sends anything.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from dex_tasks import tracing
from dex_tasks.errors import ConflictError, InvalidCallError
from dex_tasks.lazy import Deferred
from dex_tasks.limits import (
    KEY_MAX,
    SESSION_ID_MAX,
    TOOL_CALL_ID_MAX,
    TOOL_NAME_MAX,
    TURN_ID_MAX,
    check_id,
)
from dex_tasks.limits import KEY_PART_MAX as KEY_PART_MAX
from dex_tasks.limits import key_part as key_part
from dex_tasks.policy import EffectClass, ToolPolicy, parse_effect, resolve_policy
from dex_tasks.registry import InvalidArguments, canonical_json
from dex_tasks.states import CallStatus

# The store's modules import SQLAlchemy: deferred to the first call (dex_tasks.lazy).
if TYPE_CHECKING:
    from dex_tasks.store.catalog import ToolInfo
    from dex_tasks.store.records import ToolCallRecord
    from dex_tasks.store.sqljson import same_json
else:
    _deferred = Deferred(globals())
    ToolCallRecord = _deferred("dex_tasks.store.records", "ToolCallRecord")
    same_json = _deferred("dex_tasks.store.sqljson", "same_json")


def idempotency_key(session_id: str, turn_id: str, tool_call_id: str) -> str:
    """``session/turn/call``: the call's identity, the same for every attempt.

    Raises :class:`InvalidCallError` naming the field (and the limit) for an id that is empty,
    too long, holds ``/``, a NUL byte or a lone surrogate, and for a key over the limit.
    """
    for field, value, limit in (("session_id", session_id, SESSION_ID_MAX),
                                ("turn_id", turn_id, TURN_ID_MAX),
                                ("tool_call_id", tool_call_id, TOOL_CALL_ID_MAX)):
        check_id(field, value, limit, slash=False, error=InvalidCallError)
    key = f"{session_id}/{turn_id}/{tool_call_id}"
    if len(key) > KEY_MAX:
        raise InvalidCallError(
            f"the idempotency key session_id/turn_id/tool_call_id must be at most {KEY_MAX} "
            f"characters, got {len(key)}: shorten the ids"
        )
    return key


class ToolCallRequest(BaseModel):
    """One tool call a model requested in a turn: an item of ``call_tools([...])``.

    The session and turn are the batch's (``call_tools(..., session_id=, turn_id=)``); a plain
    dict with these keys is accepted as well.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tool_call_id: str
    """The model's id of this call (unique within the turn)."""
    tool: str
    """The tool's name."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The call's JSON arguments."""


def normalized_json(info: ToolInfo | None, arguments: dict[str, Any]) -> str | None:
    """The canonical JSON of ``arguments`` normalized for the tool; None when there is no tool
    to normalize for or the arguments are refused (a repeat then compares them as sent)."""
    if info is None:
        return None
    try:
        return canonical_json(info.normalize(arguments))
    except ValueError:  # InvalidArguments is one
        return None


def checked_arguments(arguments: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The arguments as a dict and as the canonical JSON the store keeps (and compares).

    :class:`InvalidCallError` for anything but a JSON object of JSON values (NaN included).
    """
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise InvalidCallError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    plain = dict(arguments)
    if not plain:  # most calls of a tool without parameters: nothing to walk or write out
        return plain, "{}"
    try:
        return plain, canonical_json(plain)
    except ValueError as err:
        raise InvalidCallError(str(err)) from None


def check_tool_name(tool: str) -> str:
    """``tool`` if it is a name the store can hold; :class:`InvalidCallError` otherwise."""
    return check_id("tool", tool, TOOL_NAME_MAX, error=InvalidCallError)


@dataclass(frozen=True)
class NewCall:
    """A call ready to insert: its row, its interrupt if it waits for approval, and the reason
    its arguments were refused (it is then stored and ended "did not run" at once)."""

    key: str
    tool: str
    args_json: str
    row: dict[str, Any]
    interrupt: dict[str, Any] | None
    invalid: str | None

    @property
    def sends_message(self) -> bool:
        """Whether a worker must get a message for it (queued, arguments valid)."""
        return self.invalid is None and self.row["status"] == CallStatus.QUEUED.value


def new_call(
    key: str, session_id: str, turn_id: str, tool_call_id: str, tool: str,
    arguments: dict[str, Any], args_json: str, info: ToolInfo, *,
    default_effect: EffectClass | str | None, approval_deadline: float | None,
    expires_in: float | None, default_max_attempts: int, now: float | None = None,
    requested_by: str | None = None,
) -> NewCall:
    """Resolve the call's policy and build its row (and interrupt), as ``call_tool`` stores it.

    The arguments are normalized first (``ToolInfo.normalize``): validated against the tool's
    code when it is in this process, else against the schema the workers published, as the
    worker's validation will treat them (coerced, defaults filled in). The approval rule judges
    the normalized arguments, which are what the call records and the worker runs: a rule
    cannot be slipped past with ``"true"`` for ``true`` or a default left out. Arguments the
    schema refuses are recorded as the model sent them and the call is ended "did not run" at
    once (``NewCall.invalid``), whatever its effect class. ``requested_by`` is the identity
    that makes the call (the MCP server's client): it may not decide the call's approval unless
    the policy allows self-approval.
    """
    policy = resolve_policy(info.policy, info.hints, default_effect)
    invalid: str | None = None
    try:
        normalized = info.normalize(arguments)
        args_json = canonical_json(normalized)
    except InvalidArguments as err:
        invalid = str(err)
    except ValueError as err:  # coerced to a value JSON cannot hold ("nan" for a number)
        invalid = f"invalid arguments for tool {tool!r}: {err}"
    if invalid is None:
        arguments = normalized
    # A rule on the arguments is evaluated here, in the agent process, from the policy the
    # catalog carries (see rules.py): no tool code is needed to decide.
    decision = policy.approval_for(arguments)
    row, interrupt = _rows(key, session_id, turn_id, tool_call_id, tool, args_json, policy,
                           approval_deadline=approval_deadline, expires_in=expires_in,
                           hold=decision.required and invalid is None,
                           default_max_attempts=default_max_attempts,
                           now=time.time() if now is None else now, requested_by=requested_by)
    row["requires_approval"] = decision.required
    snapshot = decision.snapshot()
    # Plain json.dumps: the snapshot is the rule's own checked JSON and a text of ours.
    row["approval_rule"] = (json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
                            if snapshot is not None else None)
    return NewCall(key, tool, args_json, row, interrupt, invalid)


def _rows(
    key: str, session_id: str, turn_id: str, tool_call_id: str, tool: str, args_json: str,
    policy: ToolPolicy, *, approval_deadline: float | None, expires_in: float | None,
    hold: bool, default_max_attempts: int, now: float, requested_by: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    interrupt = None
    interrupt_id = None
    if hold:
        interrupt_id = uuid.uuid4().hex
        deadline = approval_deadline or policy.approval_deadline
        interrupt = {
            "interrupt_id": interrupt_id,
            "key": key,
            "session_id": session_id,
            "deadline_at": now + deadline if deadline else None,
            "created_at": now,
            "approvals_required": policy.approvals,
            "approvals_given": 0,
            "approver_permission": policy.approver_permission,
            "webhook_urls": canonical_json(list(policy.webhooks)) if policy.webhooks else None,
            "requested_by": requested_by,
            "self_approval": policy.allow_self_approval or None,
        }
    row = {
        "key": key,
        "session_id": session_id,
        "turn_id": turn_id,
        "tool_call_id": tool_call_id,
        "tool": tool,
        "arguments": args_json,
        "effect": policy.effect.value,
        "requires_approval": policy.needs_approval,
        "max_attempts": policy.attempts(default_max_attempts),
        "time_limit": policy.time_limit,
        "status": (CallStatus.AWAITING_APPROVAL if hold else CallStatus.QUEUED).value,
        "attempts": 0,
        "interrupt_id": interrupt_id,
        # Set once the publish went through (DexClient._publish_new): a queued call with none
        # was recorded but never sent, which the next request of its key and the
        # republisher send (the republisher leaves it a few seconds, for a publish under way).
        "published_at": None,
        "expires_at": now + expires_in if expires_in else None,
        "created_at": now,
        "updated_at": now,
        # The agent's call_tool span (OpenTelemetry), when it traces: dex_tasks/tracing.py.
        "trace_context": tracing.request_span(key, session_id, turn_id, tool_call_id, tool,
                                              policy.effect.value, hold),
    }
    return row, interrupt


def request_options(
    default_effect: EffectClass | str | None, approval_deadline: float | None,
    expires_in: float | None,
) -> dict[str, Any]:
    """The options of a request besides its tool and arguments, as the store keeps them.

    A repeated request must repeat them: the same key with another session default, approval
    deadline or queue expiry is another request, not a retry of this one (see
    :func:`same_call`). Durations are the seconds ``policy.seconds`` made of them.
    """
    return {
        "default_effect": None if default_effect is None else parse_effect(default_effect).value,
        "approval_deadline": approval_deadline,
        "expires_in": expires_in,
    }


def same_call(existing: Any, tool: str, args_json: str, options: Mapping[str, Any] | None = None,
              stored_options: Mapping[str, Any] | None = None, *,
              normalized: str | None = None) -> ToolCallRecord:
    """The record of a repeated request; :class:`ConflictError` naming what differs if the
    call stored under that key has another tool, other arguments, or other options
    (``default_effect``, ``approval_deadline``, ``expires_in``). Options are compared only
    when the stored call kept them (calls recorded by an older release did not).

    A call records its arguments normalized (:func:`new_call`): the request's arguments
    (``args_json``, as the model sent them) match when they or their ``normalized`` JSON equal
    the stored ones."""
    if existing.tool != tool:
        raise ConflictError(existing.key, "tool")
    # By value: PostgreSQL's jsonb hands back its own spelling of the stored arguments. A call
    # approved with edited arguments is the same call asked with the model's arguments or with
    # the edited ones (a framework that runs an approved call with its override, Pydantic AI's
    # ToolApproved(override_args=...), asks with those).
    asked = getattr(existing, "original_arguments", None)
    if not any(same_json(stored, given)
               for stored in (existing.arguments, asked) if stored is not None
               for given in (args_json, normalized) if given is not None):
        raise ConflictError(existing.key, "arguments")
    if options is not None and stored_options is not None:
        for name in ("default_effect", "approval_deadline", "expires_in"):
            if options.get(name) != stored_options.get(name):
                raise ConflictError(existing.key, name)
    return ToolCallRecord.from_row(existing)
