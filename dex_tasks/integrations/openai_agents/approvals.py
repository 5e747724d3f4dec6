"""``apply_dex_decisions``: a paused run's approvals answered from the decisions people made
in dex-tasks.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    FunctionTool,
    RunContextWrapper,
    RunState,
    ToolApprovalItem,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolInputGuardrailTripwireTriggered,
)
from agents.tool_context import ToolContext
from openai.types.responses import ResponseFunctionToolCall

from dex_tasks import AsyncDexClient, CallNotFoundError, CallStatus, DexClient, idempotency_key
from dex_tasks.integrations.openai_agents.context import async_client, call_ids
from dex_tasks.integrations.openai_agents.tools import DexInvoker, model_text, parse_arguments


async def apply_dex_decisions(
    state: RunState[Any, Any], client: DexClient | AsyncDexClient
) -> list[ToolApprovalItem]:
    """Approve or reject the paused run's dex tool calls from the decisions people made.

    For each pending interruption of a tool from :func:`dex_function_tools`: the first time,
    run the tool's input guardrails and, if they let it pass, record the call in dex-tasks,
    held for approval; once a person has decided, ``state.approve`` or ``state.reject`` it
    (rejected with the call's error, which carries the person's message: what the model reads).

    Returns the interruptions still undecided: dex calls awaiting a person, and interruptions
    of other tools nobody approved or rejected on ``state`` (this function leaves those to
    you). An empty list means "resume now" with ``Runner.run(agent, state)``. Safe to call
    again, from any process: it records nothing twice. The calls awaiting a person are in
    ``client.get_agent_snapshot(session_id).pending_interrupts``.
    """
    dex = async_client(client)
    wrapper = _state_context(state)
    undecided: list[ToolApprovalItem] = []
    for item in state.get_interruptions():
        call_id = item.call_id
        tool = _dex_tool_for(item)
        if tool is None or call_id is None:
            if call_id is None or wrapper.is_tool_approved(item.name or "", call_id) is None:
                undecided.append(item)
            continue
        invoker = tool.on_invoke_tool
        assert isinstance(invoker, DexInvoker)
        session_id, turn_id, tool_call_id = call_ids(wrapper.context, call_id)
        try:
            record = await dex.get_tool_call(idempotency_key(session_id, turn_id, tool_call_id))
        except CallNotFoundError:
            arguments = parse_arguments(item.arguments or "")
            if isinstance(arguments, str):
                state.reject(item, rejection_message=arguments)
                continue
            refusal = await _guardrail_refusal(tool, item, wrapper, call_id)
            if refusal is not None:
                state.reject(item, rejection_message=refusal)
                continue
            record = await dex.call_tool(
                session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id,
                tool=invoker.tool, arguments=arguments, default_effect=invoker.default_effect,
            )
        if record.status is CallStatus.AWAITING_APPROVAL:
            undecided.append(item)
        elif record.status is CallStatus.REJECTED:
            state.reject(item, rejection_message=model_text(record))
        else:
            # Approved (or never held: its policy no longer asks, or its arguments were
            # refused): the invocation returns the call's result or error.
            state.approve(item)
    return undecided


def _state_context(state: RunState[Any, Any]) -> RunContextWrapper[Any]:
    """The run context a paused ``RunState`` carries.

    openai-agents 0.24 has no public accessor for it (approve/reject use the same attribute),
    so read it here, in one place; the tests fail loudly if a release moves it.
    """
    wrapper = getattr(state, "_context", None)
    if not isinstance(wrapper, RunContextWrapper):
        raise TypeError("this RunState carries no run context; was it built by Runner.run?")
    return wrapper


def _dex_tool_for(item: ToolApprovalItem) -> FunctionTool | None:
    """The dex ``FunctionTool`` an interruption is about, or None if it is another tool."""
    agent = item.agent
    if not isinstance(agent, Agent):
        return None
    for tool in agent.tools:
        if (isinstance(tool, FunctionTool) and tool.name == item.tool_name
                and isinstance(tool.on_invoke_tool, DexInvoker)):
            return tool
    return None


async def _guardrail_refusal(tool: FunctionTool, item: ToolApprovalItem,
                             wrapper: RunContextWrapper[Any], call_id: str) -> str | None:
    """Run the tool's input guardrails on a pending call, as the SDK would before running it.

    Returns the refusal message (``reject_content``), None when every guardrail allows the
    call; raises ``ToolInputGuardrailTripwireTriggered`` for ``raise_exception``, as the run
    itself would.
    """
    guardrails = tool.tool_input_guardrails or []
    if not guardrails:
        return None
    raw = item.raw_item
    tool_context = ToolContext.from_agent_context(
        wrapper, call_id,
        tool_call=raw if isinstance(raw, ResponseFunctionToolCall) else None,
        agent=item.agent, tool_name=tool.name, tool_arguments=item.arguments or "",
    )
    for guardrail in guardrails:
        output: ToolGuardrailFunctionOutput = await guardrail.run(
            ToolInputGuardrailData(context=tool_context, agent=item.agent)
        )
        behavior = output.behavior
        if behavior["type"] == "raise_exception":
            raise ToolInputGuardrailTripwireTriggered(guardrail=guardrail, output=output)
        if behavior["type"] == "reject_content":
            return behavior["message"]
    return None
