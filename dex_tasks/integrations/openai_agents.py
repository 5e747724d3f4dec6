"""OpenAI Agents SDK adapter: the agent's tools run as dex-tasks calls, approvals pause the run.

The five lines a user writes (``client`` is a ``DexClient`` or an ``AsyncDexClient``)::

    from dex_tasks.integrations.openai_agents import apply_dex_decisions, dex_function_tools
    agent = Agent(name="support", instructions="...", tools=dex_function_tools(client))
    result = await Runner.run(agent, text, context={"session_id": "s-42", "turn_id": "t-7"})
    while result.interruptions and not await apply_dex_decisions(st := result.to_state(), client):
        result = await Runner.run(agent, st)

If ``result.interruptions`` is still non-empty after the loop, a person has yet to decide: save
``st.to_string()`` and exit. Any process resumes it later: ``st = await
RunState.from_string(agent, saved)``, then the same loop from ``apply_dex_decisions`` on, with
``Runner.run(agent, st)`` (give no ``context=`` there: the state carries it).
``dex_context(session_id)`` builds the context with a fresh ``turn_id``.

How it works:

* :func:`dex_function_tools` builds one ``FunctionTool`` per tool of the published catalog
  (``client.list_tools()``): its name, description (the docstring) and parameters schema.
  ``strict_json_schema`` is on only when the catalog schema already is a strict schema (every
  property required, no extra properties): making it strict would otherwise change what the
  tool accepts. ``needs_approval`` is the tool's dex policy. Invoking the tool records the call
  with ``call_tool`` and waits for its result, which the model reads as JSON text; a call that
  failed, was rejected or whose outcome is unknown gives the model its error text instead.
* The idempotency key is ``session_id/turn_id/call id``: the session and the turn from the run
  context (:func:`dex_context`, or any mapping or object with ``session_id`` and ``turn_id``),
  and the model's tool-call id. ``RunState`` keeps all three across ``to_string``/``from_string``
  (a mapping context needs no deserializer), so a resumed, replayed or re-run step finds its
  call instead of starting a new one. Use one ``turn_id`` per ``Runner.run`` on new input: fake
  models reuse call ids from one run to the next, and within a run the SDK itself refuses to
  treat one call id as two invocations. The call id goes into the key through
  ``dex_tasks.key_part``, one-to-one: two different call ids never give one key.
* Approval uses the SDK's human-in-the-loop: a call whose policy needs approval pauses the run
  (``result.interruptions``). :func:`apply_dex_decisions` records each pending call in dex-tasks,
  which holds it ``awaiting_approval`` with an interrupt a person decides
  (``resolve_interrupt``, the approval page, ``dex-tasks approvals``); once decided it approves
  or rejects the SDK's item: approved calls run on a worker (once, whoever resumes, however
  often), a rejection reaches the model as the tool's result with the person's message.
* The SDK asks ``needs_approval`` before it runs a tool's input guardrails, so a call the
  guardrails refuse would still be put to a person. :func:`apply_dex_decisions` therefore runs
  the tool's input guardrails itself before it records a call: a refusal records nothing, and
  ends the call the way the SDK's ``pre_approval_tool_input_guardrails`` mode does (the
  guardrail's message is the tool result; ``raise_exception`` raises
  ``ToolInputGuardrailTripwireTriggered``). The SDK runs the guardrails again before an approved
  call is invoked.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import agents  # noqa: F401 - only to tell a missing extra from other import errors
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'dex_tasks.integrations.openai_agents needs the openai-agents extra: '
        'pip install "dex-tasks[openai-agents]"'
    ) from err
from agents import (
    Agent,
    FunctionTool,
    RunContextWrapper,
    RunState,
    Tool,
    ToolApprovalItem,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolInputGuardrailTripwireTriggered,
)
from agents.strict_schema import ensure_strict_json_schema
from agents.tool_context import ToolContext
from openai.types.responses import ResponseFunctionToolCall

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallNotFoundError,
    CallStatus,
    DexClient,
    DexError,
    EffectClass,
    InvalidCallError,
    ToolCallRecord,
    ToolSpec,
    UnknownToolError,
    idempotency_key,
    key_part,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "ApprovalPendingError",
    "apply_dex_decisions",
    "dex_context",
    "dex_function_tools",
]

DEFAULT_TIMEOUT = 120.0
"""Seconds a tool invocation waits for its call to end before it raises ``TimeoutError``."""


class ApprovalPendingError(DexError):
    """A tool was invoked while dex-tasks still holds its call for a person's approval.

    This happens when the SDK was told to run a call without dex-tasks having approved it:
    ``state.approve`` called directly instead of :func:`apply_dex_decisions`, or a policy that
    started to need approval after the tools were built. The tool does not run; decide the
    interrupt, then apply the decisions and resume.
    """


def dex_context(session_id: str, turn_id: str | None = None) -> dict[str, str]:
    """The run context that names the dex session and turn of one ``Runner.run``.

    ``turn_id`` defaults to a new random id, so each call gives a new turn; the ``RunState`` of
    a paused run stores the context, so resuming it keeps the same turn. A plain dict because
    ``RunState.to_string``/``from_string`` restore a mapping context as it was. Your own context
    works as well if it has ``session_id`` and ``turn_id`` (keys or attributes).
    """
    return {"session_id": session_id, "turn_id": turn_id or uuid.uuid4().hex}


def dex_function_tools(
    client: DexClient | AsyncDexClient,
    names: Sequence[str] | None = None,
    *,
    default_effect: EffectClass | str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[Tool]:
    """``FunctionTool``s for the tools the workers published (all, or ``names`` in that order).

    Each invocation runs the call through dex-tasks and waits up to ``timeout`` seconds for its
    result. ``default_effect`` is the session's default effect class for tools that have
    neither a policy nor MCP hints (``list_tools`` and ``call_tool`` take the same). The
    catalog is read once, here (a short blocking read): build the tools again to pick up
    policy changes. Raises :class:`UnknownToolError` for a name the catalog lacks.
    """
    dex = _async_client(client)
    specs = {spec.name: spec for spec in dex.sync.list_tools(default_effect)}
    if names is None:
        chosen = list(specs.values())
    else:
        missing = [name for name in names if name not in specs]
        if missing:
            raise UnknownToolError(missing[0])
        chosen = [specs[name] for name in names]
    return [_function_tool(dex, spec, default_effect, timeout) for spec in chosen]


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
    dex = _async_client(client)
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
        assert isinstance(invoker, _DexInvoker)
        session_id, turn_id, tool_call_id = _call_ids(wrapper.context, call_id)
        try:
            record = await dex.get_tool_call(idempotency_key(session_id, turn_id, tool_call_id))
        except CallNotFoundError:
            arguments = _parse_arguments(item.arguments or "")
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
            state.reject(item, rejection_message=_model_text(record))
        else:
            # Approved (or never held: its policy no longer asks, or its arguments were
            # refused): the invocation returns the call's result or error.
            state.approve(item)
    return undecided


# -- the tool -----------------------------------------------------------------------------------


class _DexInvoker:
    """``FunctionTool.on_invoke_tool`` of a dex tool: run the call through dex-tasks, wait."""

    def __init__(self, client: AsyncDexClient, tool: str,
                 default_effect: EffectClass | str | None, timeout: float) -> None:
        self.client = client
        self.tool = tool
        self.default_effect = default_effect
        self.timeout = timeout

    async def __call__(self, ctx: ToolContext[Any], input: str) -> str:
        arguments = _parse_arguments(input)
        if isinstance(arguments, str):
            return arguments
        session_id, turn_id, tool_call_id = _call_ids(ctx.context, ctx.tool_call_id)
        record = await self.client.call_tool(
            session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id, tool=self.tool,
            arguments=arguments, default_effect=self.default_effect,
        )
        if record.status is CallStatus.AWAITING_APPROVAL:
            raise ApprovalPendingError(
                f"call {record.key} of {self.tool!r} awaits a person's approval in dex-tasks "
                f"(interrupt {record.interrupt_id}); decide it, then call apply_dex_decisions "
                "and resume the run"
            )
        if not record.terminal:
            record = await self.client.wait(record.key, timeout=self.timeout)
        return _model_text(record)


def _function_tool(client: AsyncDexClient, spec: ToolSpec,
                   default_effect: EffectClass | str | None, timeout: float) -> FunctionTool:
    schema = copy.deepcopy(spec.parameters)
    return FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=schema,
        on_invoke_tool=_DexInvoker(client, spec.name, default_effect, timeout),
        strict_json_schema=_already_strict(schema),
        needs_approval=spec.policy.needs_approval,
    )


def _already_strict(schema: dict[str, Any]) -> bool:
    """True when the SDK's strict conversion leaves the schema as it is.

    Strict mode makes every property required and forbids undeclared ones; a catalog schema
    with optional arguments (a default) or open objects would accept less than the tool does,
    so those tools are sent non-strict (the worker still checks the arguments).
    """
    try:
        return ensure_strict_json_schema(copy.deepcopy(schema)) == schema
    except Exception:  # noqa: BLE001 - any refusal of the converter means "not strict"
        return False


def _model_text(record: ToolCallRecord) -> str:
    """What the model reads: the result as JSON text, else the call's error."""
    if record.status is CallStatus.SUCCEEDED:
        return json.dumps(record.result, ensure_ascii=False)
    return record.error or f"the tool call ended {record.status.value}"


def _reject_constant(value: str) -> Any:
    raise ValueError(f"{value} is not JSON")


def _parse_arguments(text: str) -> dict[str, Any] | str:
    """The model's arguments as a dict, or the text that tells the model why not."""
    if not text.strip():
        return {}
    try:
        # NaN and Infinity are not JSON: refuse them here, as the store would.
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as err:
        return f"{TOOL_DID_NOT_RUN}: the arguments are not valid JSON ({err})"
    if not isinstance(value, dict):
        return (f"{TOOL_DID_NOT_RUN}: the arguments must be a JSON object, "
                f"got {type(value).__name__}")
    return value


# -- keys -------------------------------------------------------------------------------------


def _call_ids(context: Any, call_id: str) -> tuple[str, str, str]:
    """(session_id, turn_id, tool_call_id) of a call, from the run context and the call id."""
    ids = []
    for field in ("session_id", "turn_id"):
        value = context.get(field) if isinstance(context, Mapping) else getattr(
            context, field, None)
        if not isinstance(value, str) or not value:
            raise InvalidCallError(
                f"the run context has no {field}: pass context=dex_context(session_id) to "
                f"Runner.run (or a context with session_id and turn_id), got {context!r}"
            )
        ids.append(value)
    return ids[0], ids[1], key_part(call_id)


# -- the paused run -----------------------------------------------------------------------------


def _async_client(client: DexClient | AsyncDexClient) -> AsyncDexClient:
    if isinstance(client, AsyncDexClient):
        return client
    if isinstance(client, DexClient):
        return AsyncDexClient(client=client)
    raise TypeError(f"client must be a DexClient or AsyncDexClient, got {type(client).__name__}")


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
                and isinstance(tool.on_invoke_tool, _DexInvoker)):
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

