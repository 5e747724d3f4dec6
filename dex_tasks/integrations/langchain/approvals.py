"""Resuming a graph paused on dex approvals, and LangChain's human-in-the-loop decisions
recorded in dex-tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langgraph.types import Command, StateSnapshot

from dex_tasks import AsyncDexClient, DexClient, InvalidArgumentError
from dex_tasks.integrations.langchain.calls import DEX_APPROVAL


def resume_command(state: StateSnapshot) -> Command[Any]:
    """The ``Command`` that wakes every dex approval pending in ``state`` (from
    ``agent.get_state(config)``): ``agent.invoke(resume_command(agent.get_state(config)),
    config)``.

    It names each pending dex interrupt by its LangGraph id (LangGraph needs that when several
    are pending) and leaves other interrupts alone. Calls decided in dex-tasks continue; calls
    still undecided pause the graph again. Raises ``InvalidArgumentError`` when no dex approval
    is pending.
    """
    pending = {
        item.id: {"type": "dex_wake_up"}
        for item in state.interrupts
        if isinstance(item.value, dict) and item.value.get("type") == DEX_APPROVAL
    }
    if not pending:
        raise InvalidArgumentError("no dex approval is pending in this graph state")
    return Command(resume=pending)


def apply_decisions(
    client: DexClient | AsyncDexClient,
    state: StateSnapshot,
    decisions: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    *,
    approver: str | None = None,
    permissions: Sequence[str] | None = None,
) -> Command[Any]:
    """Record a person's decisions, written as LangChain's human-in-the-loop decisions, in
    dex-tasks, and return the ``Command`` that resumes the graph (:func:`resume_command`).

    ``decisions`` are ``{"type": "approve"}``, ``{"type": "edit", "edited_action": {"name":
    tool, "args": {...}}}`` or ``{"type": "reject", "message": "..."}``: a list in the order of
    the dex approvals pending in ``state`` (as ``HumanInTheLoopMiddleware`` takes them), or a
    mapping by LangGraph interrupt id. An edit approves the call with the edited arguments
    (checked against the tool's schema, both versions recorded, the model told); ``respond``
    has no dex meaning (a dex call runs its tool or is rejected) and is refused. Every
    decision is checked before any is recorded. A call decided meanwhile keeps the first
    decision, as ``resolve_interrupt`` always does.
    """
    pending = [item for item in state.interrupts
               if isinstance(item.value, dict) and item.value.get("type") == DEX_APPROVAL]
    if isinstance(decisions, Mapping):
        unknown = sorted(set(decisions) - {item.id for item in pending})
        if unknown:
            raise InvalidArgumentError(f"decisions name interrupts no dex approval pending in "
                                       f"this state has: {unknown}")
        chosen = [(item, decisions[item.id]) for item in pending if item.id in decisions]
    else:
        if len(decisions) != len(pending):
            raise InvalidArgumentError(f"{len(decisions)} decisions for {len(pending)} pending "
                                       "dex approvals; give one each, in order")
        chosen = list(zip(pending, decisions, strict=True))
    plans = [(item.value, _decision_plan(item.value, decision)) for item, decision in chosen]
    sync = client.sync if isinstance(client, AsyncDexClient) else client
    for value, (approved, arguments, message) in plans:
        sync.resolve_interrupt(value["session_id"], value["interrupt_id"], approved,
                               rejection_message=message, approver=approver,
                               arguments=arguments, permissions=permissions)
    return resume_command(state)


def _decision_plan(value: Mapping[str, Any], decision: Mapping[str, Any],
                   ) -> tuple[bool, dict[str, Any] | None, str | None]:
    """``(approved, edited arguments, rejection message)`` for one HITL decision."""
    kind = decision.get("type") if isinstance(decision, Mapping) else None
    if kind == "approve":
        return True, None, None
    if kind == "reject":
        message = decision.get("message")
        if message is not None and not isinstance(message, str):
            raise InvalidArgumentError(f"a reject decision's message must be a string, got "
                                       f"{message!r}")
        return False, None, message
    if kind == "edit":
        action = decision.get("edited_action")
        if not isinstance(action, Mapping) or not isinstance(action.get("args"), Mapping):
            raise InvalidArgumentError("an edit decision needs edited_action with args (a "
                                       f"JSON object), got {decision!r}")
        if action.get("name", value["tool"]) != value["tool"]:
            raise InvalidArgumentError(
                f"an edit decision may change {value['tool']!r}'s arguments, not the tool "
                f"(got {action.get('name')!r})")
        return True, dict(action["args"]), None
    raise InvalidArgumentError(f"a decision's type must be approve, edit or reject, got "
                               f"{kind!r}")
