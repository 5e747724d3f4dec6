"""``DexCapability``: the capability that runs an agent's tool calls through dex-tasks and
journals its durable turns.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import (
    ApprovalRequired,
    CallDeferred,
    DeferredToolRequests,
    DeferredToolResults,
    ModelMessage,
    ModelResponse,
    RunContext,
    ToolDefinition,
    ToolFailed,
    ToolReturn,
)
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.capabilities.abstract import WrapModelRequestHandler, WrapRunHandler
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.run import AgentRunResult
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
from pydantic_core import SchemaValidator, core_schema, to_jsonable_python

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallStatus,
    ConfigurationError,
    DexClient,
    DexError,
    EffectClass,
    InvalidArgumentError,
    ToolCallRecord,
    ToolCallRequest,
    ToolSpec,
    UnknownToolError,
    tool_message_text,
)
from dex_tasks.integrations.pydantic_ai.approvals import dex_apply_decisions, dex_deferred_results
from dex_tasks.integrations.pydantic_ai.errors import TurnInProgressError
from dex_tasks.integrations.pydantic_ai.journal import (
    Journal,
    answer_text,
    dump_response,
    input_text,
    load_response,
    step_call_id,
    step_position,
    text_of,
)
from dex_tasks.integrations.pydantic_ai.keys import (
    call_key,
    deferred_metadata,
    fit_id,
    holding_response,
)

# Catalog tools take a JSON object; the published schema is checked by dex-tasks (before a person
# is asked to approve, or by the worker), which tells the model exactly which field is wrong.
_OBJECT_ARGS = SchemaValidator(core_schema.dict_schema(keys_schema=core_schema.str_schema()))

# -- the capability -----------------------------------------------------------------------------


def _runs_code(tool_def: ToolDefinition) -> bool:
    """True for a tool whose calls would run a function in the agent process: not an output or
    external tool, nor one of Pydantic AI's own typed tools (tool search, capability loading)."""
    return tool_def.kind in ("function", "unapproved") and tool_def.tool_kind is None


@dataclass
class _RunCatalog:
    """The catalog as read once per run, shared by the per-step copies of the toolset."""

    tools: dict[str, ToolSpec] | None = None


@dataclass
class _DexToolset(WrapperToolset[Any]):
    """The agent's toolset plus the catalog's tools; calls of catalog tools go to dex-tasks."""

    capability: DexCapability = field(kw_only=True)

    async def _catalog(self) -> dict[str, ToolSpec]:
        return await self.capability._catalog_tools()

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = dict(await self.wrapped.get_tools(ctx))
        catalog = await self._catalog()
        cap = self.capability
        bypassing = sorted(name for name, tool in tools.items()
                           if name not in catalog and name not in cap.local_tools
                           and _runs_code(tool.tool_def))
        if bypassing:
            raise ConfigurationError(
                f"the agent's tool(s) {', '.join(map(repr, bypassing))} are not in the dex-tasks "
                "catalog, so their calls would not run through dex-tasks: publish them from a "
                "worker's --tools module (@tool), or list them in DexCapability(local_tools=...) "
                "to run them in the agent process"
            )
        for name in cap.names if cap.names is not None else catalog:
            spec = catalog.get(name)
            if spec is None:
                raise UnknownToolError(name)
            if name not in tools:  # the agent's own definition wins; its calls still go to dex
                tools[name] = ToolsetTool(toolset=self, tool_def=_definition(spec),
                                          max_retries=1, args_validator=_OBJECT_ARGS)
        return tools

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        if name not in await self._catalog():
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        return await self.capability._run(ctx, name, tool_args)


def _definition(spec: ToolSpec) -> ToolDefinition:
    return ToolDefinition(
        name=spec.name, parameters_json_schema=spec.parameters,
        description=spec.description or None,
        # Not sent to the model; for capabilities and filters that select tools by effect.
        metadata={"dex_effect": spec.policy.effect.value,
                  "dex_needs_approval": spec.policy.needs_approval},
    )


@dataclass(init=False)
class DexCapability(AbstractCapability[Any]):
    """A Pydantic AI capability that runs every tool call of the agent through dex-tasks.

    ``client`` is a :class:`~dex_tasks.DexClient` or :class:`~dex_tasks.AsyncDexClient`.
    ``names`` limits which catalog tools are offered to the model (default: all published).
    ``session_id`` fixes the dex-tasks session of every call (default: the run's Pydantic AI
    conversation id). ``local_tools`` names tools of the agent's own that may run in the agent
    process, outside dex-tasks. ``timeout`` is how long a call waits for its result before it is
    deferred. ``default_effect`` is the session's default effect class, for tools published
    with neither a policy nor hints. See the module docstring for keys and approvals.
    """

    def __init__(
        self,
        client: DexClient | AsyncDexClient,
        *,
        names: Iterable[str] | None = None,
        session_id: str | None = None,
        local_tools: Iterable[str] = (),
        timeout: float = 120.0,
        default_effect: EffectClass | str | None = None,
        id: str | None = None,
    ) -> None:
        if isinstance(client, AsyncDexClient):
            self.client = client
        elif isinstance(client, DexClient):
            self.client = AsyncDexClient(client=client)
        else:
            raise InvalidArgumentError(
                f"client must be a DexClient or an AsyncDexClient, got {type(client).__name__}"
            )
        if session_id is not None and not isinstance(session_id, str):
            raise InvalidArgumentError(
                f"session_id must be a string or None, got {type(session_id).__name__}"
            )
        if isinstance(names, str) or isinstance(local_tools, str):
            raise InvalidArgumentError("names and local_tools must be lists of tool names, "
                                       "not a single string")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, "
                                       f"got {timeout!r}")
        self.names = None if names is None else list(names)
        self.session_id = None if session_id is None else fit_id(session_id)
        self.local_tools = frozenset(local_tools)
        self.timeout = float(timeout)
        self.default_effect = default_effect
        self.id = id

        self._catalog = _RunCatalog()
        self._journal: Journal | None = None

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds a client: not part of an agent spec

    async def for_run(self, ctx: RunContext[Any]) -> AbstractCapability[Any]:
        """A copy per run: the catalog is read, and the durable turn kept, per run."""
        run = copy.copy(self)
        run._catalog = _RunCatalog()
        run._journal = None
        return run

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        """Wrap the agent's assembled toolset, once per run (the catalog is read per run)."""
        return _DexToolset(toolset, capability=self)

    async def _catalog_tools(self) -> dict[str, ToolSpec]:
        if self._catalog.tools is None:
            specs = await self.client.list_tools(self.default_effect)
            self._catalog.tools = {spec.name: spec for spec in specs}
        return self._catalog.tools

    async def wrap_run(self, ctx: RunContext[Any], *, handler: WrapRunHandler) -> Any:
        """With ``session_id``: begin the session's durable turn with the run's input, or
        continue the one a killed process left open; end it when the run ends with an answer
        (a run that pauses on deferred calls leaves it open)."""
        if self.session_id is None:
            return await handler()
        text = input_text(ctx.prompt, ctx.messages)
        turn = await self.client.begin_turn(self.session_id, text)
        if turn.queued_input:
            raise TurnInProgressError(self.session_id, turn)
        self._journal = Journal(self.session_id, turn)
        result: AgentRunResult[Any] = await handler()
        if not isinstance(result.output, DeferredToolRequests):
            held = self._journal.held
            await self.client.end_turn(self.session_id, turn.turn_id, answer_text(result.output),
                                       response=None if held is None else dump_response(held[1]))
        return result

    async def wrap_model_request(self, ctx: RunContext[Any], *,
                                 request_context: ModelRequestContext,
                                 handler: WrapModelRequestHandler) -> ModelResponse:
        """In a durable turn: replay the journaled response of this step instead of asking the
        model; otherwise ask it, and journal the response with its calls (``record_step``)
        before any of them is sent."""
        journal = self._journal
        if journal is None:
            return await handler(request_context)
        position = step_position(request_context.messages)
        turn = journal.turn
        if journal.held is not None and journal.held[0] < position:
            # The model is asked again after a response without tools (an output retry):
            # that response was a step after all.
            held_at, held = journal.held
            journal.held = None
            await self._record(journal, held_at, held)
        step = turn.step(position)
        if step is not None:
            response = load_response(step.response)
            journal.records = {}
            by_id = {record.tool_call_id: record for record in step.calls}
            for part in response.tool_calls:
                record = by_id.get(step_call_id(position, part.tool_call_id))
                if record is not None:
                    journal.records[part.tool_call_id] = record
            if any(r.status is CallStatus.QUEUED for r in step.calls):
                # Recording the step again sends a call whose recorder died before its publish.
                await self._record(journal, position, response)
            return response
        response = await handler(request_context)
        if response.tool_calls:
            await self._record(journal, position, response)
        else:
            journal.records = {}
            journal.held = (position, response)
        return response

    async def _record(self, journal: Journal, position: int, response: ModelResponse) -> None:
        """Journal ``response`` as step ``position`` with its calls of catalog tools."""
        catalog = await self._catalog_tools()
        requests = [ToolCallRequest(tool_call_id=step_call_id(position, part.tool_call_id),
                                    tool=part.tool_name,
                                    arguments=to_jsonable_python(part.args_as_dict()))
                    for part in response.tool_calls if part.tool_name in catalog]
        records = await self.client.record_step(
            journal.session_id, journal.turn.turn_id, position, dump_response(response), requests,
            text=text_of(response), default_effect=self.default_effect)
        by_id = {record.tool_call_id: record for record in records}
        journal.records = {part.tool_call_id: by_id[step_call_id(position, part.tool_call_id)]
                           for part in response.tool_calls
                           if step_call_id(position, part.tool_call_id) in by_id}

    async def deferred_results(
        self, paused: DeferredToolRequests | Sequence[ModelMessage]
    ) -> DeferredToolResults:
        """The answers dex-tasks recorded for a paused run; see :func:`dex_deferred_results`."""
        return await dex_deferred_results(self.client, paused, session_id=self.session_id)

    async def apply_decisions(
        self, paused: DeferredToolRequests | Sequence[ModelMessage],
        decisions: DeferredToolResults, *, approver: str | None = None,
        permissions: Sequence[str] | None = None,
    ) -> DeferredToolResults:
        """Pydantic AI decisions recorded in dex-tasks; see :func:`dex_apply_decisions`."""
        return await dex_apply_decisions(self.client, paused, decisions, approver=approver,
                                         permissions=permissions, session_id=self.session_id)

    async def _run(self, ctx: RunContext[Any], tool: str, arguments: dict[str, Any]) -> Any:
        """One tool call through dex-tasks: record it (or find it), then wait for its end."""
        if ctx.tool_call_id is None:
            raise DexError(f"Pydantic AI called {tool!r} without a tool_call_id")
        journal = self._journal
        record = None if journal is None else journal.records.get(ctx.tool_call_id)
        if record is not None and record.status is CallStatus.AWAITING_APPROVAL:
            record = await self.client.get_tool_call(record.key)  # decided since it was read?
        if record is None:
            record = await self._call(ctx, tool, arguments)
        if record.status is CallStatus.AWAITING_APPROVAL:
            raise ApprovalRequired(metadata=deferred_metadata(record))
        try:
            record = await self.client.wait(record.key, timeout=self.timeout)
        except TimeoutError:
            # Still queued or running on a worker: pause the run instead of giving up on the
            # call; resuming enters here again with the same key and waits for the same call.
            raise CallDeferred(metadata=deferred_metadata(record)) from None
        if record.status is CallStatus.SUCCEEDED:
            if record.arguments_edit:
                # The tool ran with the arguments a person edited: the model is told so, next
                # to the result (Pydantic AI's own override_args tells it nothing).
                return ToolReturn(return_value=record.result,
                                  content=f"{tool} call {ctx.tool_call_id}: "
                                          f"{record.arguments_edit}",
                                  metadata={"dex_key": record.key,
                                            "dex_original_arguments": record.original_arguments})
            return record.result
        error = record.error or f"the tool call ended {record.status.value}"
        if record.status is CallStatus.OUTCOME_UNKNOWN and record.key not in error:
            error += f" The call's idempotency key is {record.key}."
        raise ToolFailed(tool_message_text(record, error))

    async def _call(self, ctx: RunContext[Any], tool: str,
                    arguments: dict[str, Any]) -> ToolCallRecord:
        """Record the call (or find it) under its key: in a durable turn, that of the step
        holding it (a call of a resumed history's response, not journaled by this run);
        otherwise built from the response (see the module docstring)."""
        assert ctx.tool_call_id is not None
        response = holding_response(ctx.messages, ctx.tool_call_id)
        journal = self._journal
        if journal is not None:
            at = max(i for i, m in enumerate(ctx.messages) if m is response)
            session, turn = journal.session_id, journal.turn.turn_id
            call = step_call_id(step_position(ctx.messages, at), ctx.tool_call_id)
        else:
            session, turn, call = call_key(self.session_id, response, ctx.tool_call_id,
                                            ctx.conversation_id)
        try:
            return await self.client.call_tool(
                session_id=session, turn_id=turn, tool_call_id=call, tool=tool,
                arguments=to_jsonable_python(arguments), default_effect=self.default_effect,
            )
        except UnknownToolError as err:
            # Unpublished since this run read the catalog: nothing ran, the model can adapt.
            raise ToolFailed(f"{TOOL_DID_NOT_RUN}: {err}") from None
