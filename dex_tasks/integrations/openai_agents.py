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
  tool accepts. ``needs_approval`` is the tool's dex policy: a flag, or for a rule on the
  arguments (``requires_approval=when(...)``) a callable that asks the rule, so that only the
  calls it sends to a person pause the run. Invoking the tool records the call
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
* Edits: the SDK has no edit decision of its own (``RunState.approve`` takes no arguments).
  A person edits in dex-tasks, ``resolve_interrupt(..., arguments=...)`` (the page's edit box,
  ``dex-tasks approvals approve --arguments``); :func:`apply_dex_decisions` then approves the
  SDK's item and the invocation runs the dex call under its key, with the edited arguments.
  The model reads the result after the note that says what was changed.
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
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from contextvars import ContextVar
from typing import Any

from dex_tasks.integrations.extras import needs_extra

with needs_extra("openai-agents", "dex_tasks.integrations.openai_agents"):
    import agents  # noqa: F401 - only to tell a missing extra from other import errors
from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    Model,
    ModelProvider,
    ModelResponse,
    MultiProvider,
    RunConfig,
    RunContextWrapper,
    RunState,
    Tool,
    ToolApprovalItem,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolInputGuardrailTripwireTriggered,
)
from agents.items import TResponseOutputItem
from agents.run_config import CallModelData, ModelInputData
from agents.strict_schema import ensure_strict_json_schema
from agents.tool_context import ToolContext
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import TypeAdapter

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    ApprovalRule,
    AsyncDexClient,
    CallNotFoundError,
    CallStatus,
    DexClient,
    DexError,
    EffectClass,
    InvalidCallError,
    ToolCallRecord,
    ToolPolicy,
    ToolSpec,
    UnknownToolError,
    idempotency_key,
    key_part,
    tool_message_text,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "ApprovalPendingError",
    "CallStillRunningError",
    "apply_dex_decisions",
    "dex_context",
    "dex_function_tools",
    "dex_run_config",
]

log = logging.getLogger("dex_tasks.integrations.openai_agents")

DEFAULT_TIMEOUT = 120.0
"""Seconds a tool invocation waits for its call to end before it raises ``TimeoutError``."""


class ApprovalPendingError(DexError, AgentsException):
    """A tool was invoked while dex-tasks still holds its call for a person's approval.

    This happens when the SDK was told to run a call without dex-tasks having approved it:
    ``state.approve`` called directly instead of :func:`apply_dex_decisions`, or a policy that
    started to need approval after the tools were built. The tool does not run; decide the
    interrupt, then apply the decisions and resume. An ``AgentsException``, so the SDK passes
    it on as it is (not as a ``UserError``); under :func:`dex_run_config` the turn is in the
    store, and running the same ``Runner.run`` again continues it.
    """


class CallStillRunningError(DexError, AgentsException):
    """A tool's call had not ended when the invocation stopped waiting (``timeout``).

    The call goes on on its worker and ends on its own. Under :func:`dex_run_config`, run the
    same ``Runner.run`` again (same session, same input): the turn continues from the store
    and the invocation waits for the same call, which never starts twice.
    """


def dex_context(session_id: str, turn_id: str | None = None, *,
                client: DexClient | AsyncDexClient | None = None) -> dict[str, str]:
    """The run context that names the dex session and turn of one ``Runner.run``.

    With ``client``: the session's open turn when it has one (the agent process was restarted
    mid-turn: running the same ``Runner.run`` with :func:`dex_run_config` continues it), else
    no ``turn_id``, which :func:`dex_run_config` gives the run when it begins the turn. Without
    ``client``, ``turn_id`` defaults to a new random id (for runs without
    :func:`dex_run_config`). A plain dict because ``RunState.to_string``/``from_string``
    restore a mapping context as it was. Your own context works as well if it has
    ``session_id`` and ``turn_id`` (keys or attributes).
    """
    if turn_id is not None:
        return {"session_id": session_id, "turn_id": turn_id}
    if client is None:
        return {"session_id": session_id, "turn_id": uuid.uuid4().hex}
    open_turn = _sync(client).open_turn(session_id)
    if open_turn is None:
        return {"session_id": session_id}
    return {"session_id": session_id, "turn_id": open_turn.turn_id}


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
            try:
                record = await self.client.wait(record.key, timeout=self.timeout)
            except TimeoutError as err:
                raise CallStillRunningError(
                    f"call {record.key} of {self.tool!r} has not ended after {self.timeout}s; "
                    "it goes on on its worker. Run the same Runner.run again (same session "
                    "and input, run_config=dex_run_config(client)) to keep waiting: the turn "
                    "continues from the store and the call never starts twice"
                ) from err
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
        needs_approval=_needs_approval(spec.policy),
    )


def _needs_approval(policy: ToolPolicy) -> bool | Callable[..., Awaitable[bool]]:
    """``needs_approval`` for a tool with this dex policy: a flag, or for a rule on the
    arguments the SDK's callable, which asks the rule (``ToolPolicy.approval_for``, the very
    evaluation ``call_tool`` makes from the catalog's policy) so that only the calls the rule
    sends to a person pause the run. A rule that cannot be evaluated pauses it (fail closed)."""
    if not isinstance(policy.requires_approval, ApprovalRule):
        return policy.needs_approval

    async def asks_the_rule(_ctx: RunContextWrapper[Any], arguments: dict[str, Any],
                            _call_id: str) -> bool:
        return policy.approval_for(arguments).required

    return asks_the_rule


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
    """What the model reads: the result as JSON text, else the call's error; after the edit
    note when a person approved edited arguments."""
    return tool_message_text(record)


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


def _sync(client: DexClient | AsyncDexClient) -> DexClient:
    return _async_client(client).sync


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



# -- durable turns: the journaled model ---------------------------------------------------------

# The agent and run context of the model request about to be made: set by the run config's
# call_model_input_filter, which the SDK calls just before each request in the same task, and
# read by the journaled model (the SDK passes a Model neither).
_REQUEST: ContextVar[tuple[Agent[Any], Any] | None] = ContextVar("dex_model_request",
                                                                 default=None)
_STEP = "dex_step"
_OUTPUT = TypeAdapter(list[TResponseOutputItem])


def dex_run_config(client: DexClient | AsyncDexClient, *,
                   model_provider: ModelProvider | None = None,
                   allow_mcp_servers: bool = False, **options: Any) -> RunConfig:
    """A ``RunConfig`` whose model requests are journaled in the dex session (durable turns).

    ``Runner.run(agent, input, context=dex_context(session_id, client=client),
    run_config=dex_run_config(client))``: each model response is recorded in the session, its
    dex tool calls in the same transaction (``record_step``), before any call is sent; an
    answer without tools ends the turn (``end_turn``). Run again after the process died
    (same session, same input), each journaled response is replayed from the store instead of
    asking the model, so its calls get the same keys: calls made are awaited, never started
    again. Then follow with the ``apply_dex_decisions`` loop, as in the first process.

    Whichever model the agent uses is journaled: a ``Model`` instance set on the ``Agent``, or
    a model name resolved by ``model_provider`` (default: the SDK's ``MultiProvider``).
    ``options`` are other ``RunConfig`` fields (a ``call_model_input_filter`` given there runs
    first). An agent with ``mcp_servers`` is refused: their tools would run in this process
    without a record; ``allow_mcp_servers=True`` runs it anyway, with a warning.
    Streaming runs (``Runner.run_streamed``) are not journaled: they raise ``UserError``.
    """
    journal = _Journal(_async_client(client), model_provider or MultiProvider(),
                       allow_mcp_servers)
    user_filter = options.pop("call_model_input_filter", None)

    async def before_request(data: CallModelData[Any]) -> ModelInputData:
        model_data = data.model_data
        if user_filter is not None:
            updated = user_filter(data)
            model_data = await updated if hasattr(updated, "__await__") else updated
        await journal.begin(data.agent, data.context, model_data)
        _REQUEST.set((data.agent, data.context))
        return model_data

    return RunConfig(model=_JournaledModel(journal), call_model_input_filter=before_request,
                     **options)


class _Journal:
    """The dex side of the journaled model: begin the turn, replay or record each step."""

    def __init__(self, client: AsyncDexClient, provider: ModelProvider,
                 allow_mcp_servers: bool) -> None:
        self.client = client
        self.provider = provider
        self.allow_mcp_servers = allow_mcp_servers
        # The journaled responses of the turns this journal began, by (session, turn) and step:
        # begin_turn returns them, and this process writes the later ones itself, so replaying
        # them needs no read of the store per model request.
        self.known: dict[tuple[str, str], dict[int, str]] = {}

    async def begin(self, agent: Agent[Any], context: Any, model_data: ModelInputData) -> None:
        if agent.mcp_servers:
            names = [getattr(server, "name", repr(server)) for server in agent.mcp_servers]
            message = (f"agent {agent.name!r} has mcp_servers {names}: their tools run in this "
                       "process, not through dex-tasks, and leave no record; serve them from "
                       "a worker with dex_tasks.integrations.mcp.mcp_tools instead")
            if not self.allow_mcp_servers:
                raise InvalidCallError(message + " (or pass allow_mcp_servers=True)")
            log.warning(message, extra={"action": "mcp_servers_unrecorded"})
        if _get(context, _STEP) is not None:
            return  # a step of a run already begun (or a RunState resumed)
        session_id = _required(context, "session_id")
        turn = await self.client.begin_turn(session_id, _input_text(model_data),
                                            turn_id=_get(context, "turn_id") or None)
        self.known[(session_id, turn.turn_id)] = {s.step: s.response for s in turn.steps}
        _put(context, "turn_id", turn.turn_id)
        _put(context, _STEP, 0)

    def model_for(self, agent: Agent[Any]) -> Model:
        if isinstance(agent.model, Model):
            return agent.model
        return self.provider.get_model(agent.model)

    async def replay(self, session_id: str, turn_id: str, step: int) -> ModelResponse | None:
        steps = self.known.get((session_id, turn_id))
        if steps is None:  # a RunState resumed here: read what the turn has journaled
            turn = await self.client.open_turn(session_id)
            if turn is None or turn.turn_id != turn_id:
                return None
            steps = self.known[(session_id, turn_id)] = {s.step: s.response
                                                         for s in turn.steps}
        response = steps.get(step)
        return None if response is None else _load_response(response)

    async def record(self, session_id: str, turn_id: str, step: int, response: ModelResponse,
                     tools: Sequence[Tool]) -> None:
        calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
        text = _response_text(response)
        dumped = _dump_response(response)
        if not calls:
            await self.client.end_turn(session_id, turn_id, text or "(no text)", response=dumped)
            self.known.setdefault((session_id, turn_id), {})[step] = dumped
            return
        dex_tools = {t.name: t.on_invoke_tool for t in tools if isinstance(t, FunctionTool)
                     and isinstance(t.on_invoke_tool, _DexInvoker)}
        requests = []
        for call in calls:
            invoker = dex_tools.get(call.name)
            arguments = _parse_arguments(call.arguments or "")
            if invoker is None or isinstance(arguments, str):
                continue  # another tool, or arguments the invocation will refuse
            requests.append({"tool_call_id": key_part(call.call_id), "tool": invoker.tool,
                             "arguments": arguments})
        # One transaction for the response and its calls, one publish (call_tools).
        await self.client.record_step(session_id, turn_id, step, dumped, requests,
                                      text=text or None)
        # Known once journaled (not before: a failed write must not be replayed as if kept).
        self.known.setdefault((session_id, turn_id), {})[step] = dumped


class _JournaledModel(Model):
    """The model of a :func:`dex_run_config` run: the agent's own model, journaled."""

    def __init__(self, journal: _Journal) -> None:
        self.journal = journal

    async def get_response(self, system_instructions: str | None,
                           input: Any, model_settings: Any, tools: list[Tool],
                           output_schema: Any, handoffs: Any, tracing: Any, *,
                           previous_response_id: str | None, conversation_id: str | None,
                           prompt: Any) -> ModelResponse:
        request = _REQUEST.get()
        if request is None:
            raise InvalidCallError("dex_run_config's model was called outside its run config")
        agent, context = request
        session_id, turn_id = _required(context, "session_id"), _required(context, "turn_id")
        step = int(_get(context, _STEP) or 0)
        response = await self.journal.replay(session_id, turn_id, step)
        if response is None:
            response = await self.journal.model_for(agent).get_response(
                system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing, previous_response_id=previous_response_id,
                conversation_id=conversation_id, prompt=prompt)
            await self.journal.record(session_id, turn_id, step, response, tools)
        _put(context, _STEP, step + 1)
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        from agents import UserError

        raise UserError("dex_run_config journals Runner.run; Runner.run_streamed is not "
                        "journaled: use Runner.run")


def _get(context: Any, field: str) -> Any:
    return context.get(field) if isinstance(context, Mapping) else getattr(context, field, None)


def _put(context: Any, field: str, value: Any) -> None:
    if isinstance(context, MutableMapping):
        context[field] = value
    else:
        setattr(context, field, value)


def _required(context: Any, field: str) -> str:
    value = _get(context, field)
    if not isinstance(value, str) or not value:
        raise InvalidCallError(
            f"the run context has no {field}: pass context=dex_context(session_id, "
            f"client=client) to Runner.run, got {context!r}")
    return value


def _input_text(model_data: ModelInputData) -> str:
    """The user's input of the turn: the text of the last user message sent to the model."""
    for item in reversed(model_data.input):
        if isinstance(item, Mapping) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return json.dumps(content, sort_keys=True, default=str)
    return json.dumps(model_data.input, sort_keys=True, default=str)


def _response_text(response: ModelResponse) -> str:
    return "".join(str(getattr(part, "text", "") or "") for item in response.output
                   if isinstance(item, ResponseOutputMessage) for part in item.content)


def _dump_response(response: ModelResponse) -> str:
    return json.dumps({
        "output": [item.model_dump(mode="json", exclude_unset=True) for item in response.output],
        "response_id": response.response_id,
        "request_id": response.request_id,
    }, ensure_ascii=False)


def _load_response(text: str) -> ModelResponse:
    data = json.loads(text)
    # A replayed response asked no model: no usage to count.
    return ModelResponse(output=_OUTPUT.validate_python(data["output"]), usage=Usage(),
                         response_id=data.get("response_id"),
                         request_id=data.get("request_id"))
