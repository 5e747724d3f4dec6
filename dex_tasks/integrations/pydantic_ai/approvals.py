"""Resuming a paused run: its deferred calls answered from what dex-tasks recorded, and
decisions made the Pydantic AI way recorded in dex-tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic_ai import (
    DeferredToolRequests,
    DeferredToolResults,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ToolApproved,
    ToolDenied,
)

from dex_tasks import (
    AsyncDexClient,
    CallNotFoundError,
    CallStatus,
    DexClient,
    ToolCallRecord,
    idempotency_key,
)
from dex_tasks.integrations.pydantic_ai.errors import ApprovalPendingError
from dex_tasks.integrations.pydantic_ai.journal import step_call_id, step_position
from dex_tasks.integrations.pydantic_ai.keys import call_key, fit_id

# -- resuming -----------------------------------------------------------------------------------


def _pending_calls(messages: Sequence[ModelMessage]) -> tuple[ModelResponse, list[str]] | None:
    """The last model response and the ids of its calls that no later request answers."""
    for index in range(len(messages) - 1, -1, -1):
        response = messages[index]
        if isinstance(response, ModelResponse):
            answered = {getattr(part, "tool_call_id", None)
                        for later in messages[index + 1:] if isinstance(later, ModelRequest)
                        for part in later.parts}
            return response, [part.tool_call_id for part in response.tool_calls
                              if part.tool_call_id not in answered]
    return None


async def dex_deferred_results(
    client: DexClient | AsyncDexClient,
    paused: DeferredToolRequests | Sequence[ModelMessage],
    *,
    session_id: str | None = None,
) -> DeferredToolResults:
    """Answer a paused run's deferred calls from what dex-tasks recorded.

    ``paused`` is the run's ``DeferredToolRequests`` output (its metadata holds each call's
    ``dex_key``) or its message history (the keys are rebuilt from it, as the capability built
    them; pass the capability's ``session_id`` if it had one). Each call dex-tasks knows is
    answered: rejected (by a person or the deadline) with ``ToolDenied`` carrying the call's
    error, which the model reads; otherwise (approved, queued, running or finished) with
    ``ToolApproved``, so that resuming runs it through dex-tasks under its key, which starts it
    at most once and returns its result. Calls dex-tasks does not know are left out, for the
    caller to answer (``DeferredToolResults.update``). Raises :class:`ApprovalPendingError` if a
    call still waits for a person: resume after it is decided.
    """
    aclient = async_client(client)
    keys = await _paused_keys(aclient, paused, session_id)
    results = DeferredToolResults()
    waiting: list[ToolCallRecord] = []
    for call_id, key in keys.items():
        try:
            record = await aclient.get_tool_call(key)
        except CallNotFoundError:
            continue  # not a dex-tasks call (the agent's own deferred tool, say)
        if record.status is CallStatus.AWAITING_APPROVAL:
            waiting.append(record)
        elif record.status is CallStatus.REJECTED:
            results.approvals[call_id] = ToolDenied(record.error or "the tool call was rejected")
        else:
            # Approved with edited arguments: said natively too (the run calls the tool with
            # them; dex-tasks takes them as the same call and runs it once, under its key).
            results.approvals[call_id] = ToolApproved(
                override_args=record.arguments if record.original_arguments is not None
                else None)
    if waiting:
        raise ApprovalPendingError(waiting)
    return results


def async_client(client: DexClient | AsyncDexClient) -> AsyncDexClient:
    return client if isinstance(client, AsyncDexClient) else AsyncDexClient(client=client)


async def _paused_keys(aclient: AsyncDexClient,
                       paused: DeferredToolRequests | Sequence[ModelMessage],
                       session_id: str | None) -> dict[str, str]:
    """The dex key of each deferred call of a paused run, by the model's tool-call id."""
    keys: dict[str, str] = {}
    if isinstance(paused, DeferredToolRequests):
        for call in [*paused.approvals, *paused.calls]:
            key = paused.metadata.get(call.tool_call_id, {}).get("dex_key")
            if isinstance(key, str):
                keys[call.tool_call_id] = key
    else:
        found = _pending_calls(paused)
        if found is not None:
            response, call_ids = found
            fitted = None if session_id is None else fit_id(session_id)
            # With a session, the capability ran a durable turn: the calls are keyed by the
            # open turn and the step of the response that holds them.
            turn = None if fitted is None else await aclient.open_turn(fitted)
            for call_id in call_ids:
                if fitted is not None and turn is not None:
                    at = max(i for i, m in enumerate(paused) if m is response)
                    keys[call_id] = idempotency_key(
                        fitted, turn.turn_id, step_call_id(step_position(paused, at), call_id))
                else:
                    keys[call_id] = idempotency_key(*call_key(fitted, response, call_id))
    return keys


async def dex_apply_decisions(
    client: DexClient | AsyncDexClient,
    paused: DeferredToolRequests | Sequence[ModelMessage],
    decisions: DeferredToolResults,
    *,
    approver: str | None = None,
    permissions: Sequence[str] | None = None,
    session_id: str | None = None,
) -> DeferredToolResults:
    """Record decisions made the Pydantic AI way (your own approval UI builds
    ``DeferredToolResults``) in dex-tasks, then answer the paused run from dex-tasks' records.

    For each dex call ``decisions.approvals`` answers: ``ToolApproved()`` (or ``True``)
    approves it, ``ToolApproved(override_args={...})`` approves it with those arguments (an
    edit: ``resolve_interrupt(..., arguments=...)``, checked against the tool's schema,
    :class:`~dex_tasks.InvalidEditError` naming the field otherwise), ``ToolDenied(message)``
    (or ``False``) rejects it with the message. ``approver`` and ``permissions`` are the
    person's, as for ``resolve_interrupt``. A call someone else decided first keeps that
    decision. Returns :func:`dex_deferred_results` (so every answer is what dex-tasks
    recorded, and a call that still needs another approver raises
    :class:`ApprovalPendingError`), plus the answers
    of ``decisions`` for calls dex-tasks does not know.
    """
    aclient = async_client(client)
    keys = await _paused_keys(aclient, paused, session_id)
    for call_id, decision in decisions.approvals.items():
        key = keys.get(call_id)
        if key is None:
            continue
        try:
            record = await aclient.get_tool_call(key)
        except CallNotFoundError:
            continue
        if record.status is not CallStatus.AWAITING_APPROVAL or record.interrupt_id is None:
            continue
        if isinstance(decision, ToolDenied) or decision is False:
            message = decision.message if isinstance(decision, ToolDenied) else None
            await aclient.resolve_interrupt(record.session_id, record.interrupt_id, False,
                                            rejection_message=message,
                                            approver=approver, permissions=permissions)
        else:  # True or ToolApproved
            edit = decision.override_args if isinstance(decision, ToolApproved) else None
            await aclient.resolve_interrupt(record.session_id, record.interrupt_id, True,
                                            approver=approver, permissions=permissions,
                                            arguments=edit)
    answered = await dex_deferred_results(aclient, paused, session_id=session_id)
    for call_id, decision in decisions.approvals.items():
        answered.approvals.setdefault(call_id, decision)
    answered.calls = {**decisions.calls, **answered.calls}
    return answered
