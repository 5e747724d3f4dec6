"""Durable turns: ``dex_run_config``, whose model is the agent's own, journaled in the session."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    Model,
    ModelProvider,
    ModelResponse,
    MultiProvider,
    RunConfig,
    Tool,
)
from agents.items import TResponseOutputItem
from agents.run_config import CallModelData, ModelInputData
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import TypeAdapter

from dex_tasks import (
    AsyncDexClient,
    DexClient,
    DexError,
    InvalidCallError,
    Turn,
    TurnConflictError,
    key_part,
)
from dex_tasks.integrations.openai_agents.context import (
    async_client,
    get_field,
    put_field,
    required_field,
)
from dex_tasks.integrations.openai_agents.tools import DexInvoker, parse_arguments

log = logging.getLogger("dex_tasks.integrations.openai_agents")

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
    journal = _Journal(async_client(client), model_provider or MultiProvider(),
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


class TurnInProgressError(DexError, AgentsException):
    """``Runner.run`` was given another input while the session's durable turn is still open.

    The input is queued as a user message of the session (``queued`` in its snapshot), as the
    seeds' sessions queue a message sent during a turn, and nothing else happens: the model is
    not asked, none of the open turn's journaled responses is replayed for this input, none of
    its pending approvals is surfaced as if this input had asked for it. The open turn goes on
    as before (its own input run again, or its paused ``RunState`` resumed). When it ends, the
    message is delivered; running this same input again then begins its turn from that
    message (stored once) and the model answers it. ``turn`` is the open turn (its
    ``turn_id``, its ``input``). An ``AgentsException``, so the SDK passes it on as it is.
    """

    def __init__(self, session_id: str, turn: Turn, queued: str) -> None:
        super().__init__(
            f"session {session_id!r} has an open turn ({turn.turn_id!r}, begun with "
            f"{turn.input!r}): this input ({queued!r}) was queued for after it and the model "
            "was not asked; run it again once that turn has ended (its own input run again, "
            "or its paused RunState resumed)")
        self.session_id = session_id
        self.turn = turn
        self.queued = queued


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
        if get_field(context, _STEP) is not None:
            return  # a step of a run already begun (or a RunState resumed)
        session_id = required_field(context, "session_id")
        text = _input_text(model_data)
        requested = get_field(context, "turn_id") or None
        try:
            turn = await self.client.begin_turn(session_id, text, turn_id=requested)
        except TurnConflictError:
            # dex_context(session, client=...) named the session's open turn, and this run's
            # input is another: it waits behind that turn like any other input.
            current = await self.client.open_turn(session_id)
            if current is None or current.turn_id != requested:
                raise
            turn = await self.client.begin_turn(session_id, text)
        if turn.queued_input:
            raise TurnInProgressError(session_id, turn, text)
        self.known[(session_id, turn.turn_id)] = {s.step: s.response for s in turn.steps}
        put_field(context, "turn_id", turn.turn_id)
        put_field(context, _STEP, 0)

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
                     and isinstance(t.on_invoke_tool, DexInvoker)}
        requests = []
        for call in calls:
            invoker = dex_tools.get(call.name)
            arguments = parse_arguments(call.arguments or "")
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
        session_id = required_field(context, "session_id")
        turn_id = required_field(context, "turn_id")
        step = int(get_field(context, _STEP) or 0)
        response = await self.journal.replay(session_id, turn_id, step)
        if response is None:
            response = await self.journal.model_for(agent).get_response(
                system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing, previous_response_id=previous_response_id,
                conversation_id=conversation_id, prompt=prompt)
            await self.journal.record(session_id, turn_id, step, response, tools)
        put_field(context, _STEP, step + 1)
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        from agents import UserError

        raise UserError("dex_run_config journals Runner.run; Runner.run_streamed is not "
                        "journaled: use Runner.run")



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
