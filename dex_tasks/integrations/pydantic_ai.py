"""Pydantic AI: every tool call of an agent runs through dex-tasks; approvals are deferred tools.

The lines a user adds (``pip install "dex-tasks[pydantic-ai]"``)::

    from dex_tasks import DexClient
    from dex_tasks.integrations.pydantic_ai import DexCapability
    dex = DexCapability(DexClient.from_env())
    agent = Agent(model, capabilities=[dex], output_type=[str, DeferredToolRequests])
    results = await dex.deferred_results(history)  # on resume: deferred_tool_results=results

With ``session_id=`` each run is a durable turn (the five lines of ``docs/durable-turns.md``)::

    from dex_tasks import DexClient
    from dex_tasks.integrations.pydantic_ai import DexCapability
    client = DexClient.from_env()
    dex = DexCapability(client, session_id="ticket-42")
    result = await agent.run("Refund order 1001", capabilities=[dex])

**Durable turns** (``session_id=`` given). The run begins the session's turn with its input
(``client.begin_turn``), or continues the one a killed process left open: running the same
code again with the same session and input is the restart, with no history saved by hand.
Every model request of the turn is a step (its position: the responses since the turn's user
prompt): a journaled step's response is replayed from the store instead of asking the model
(``wrap_model_request`` returns it without calling the model, as Pydantic AI's Temporal and DBOS
integrations replay a recorded activity); a new response that calls tools is journaled with its
calls of catalog tools (``client.record_step``: one transaction) before any call is sent. A
response without tool calls is the answer: the run's output ends the turn (``end_turn``), and
the session's user messages that waited for it are delivered; a run that ends on deferred calls
leaves it open. Keys are ``session/turn/<step>.<the model's call id>``, all taken from the
journaled response, so a replay gives the same keys even though a real model mints new ids each
time it is asked (and fake models that reuse ids get distinct keys). A run with another input
while the session's turn is open raises :class:`TurnInProgressError` (the input is queued).

**Which tools.** The capability wraps the agent's toolset (``get_wrapper_toolset``) and adds the
tools the workers published to the dex-tasks catalog (``client.list_tools()``: name, docstring,
JSON schema), so the agent process need not import any tool code; ``names=`` picks some of them.
A tool the agent defines itself (``@agent.tool``, a toolset) under the name of a catalog tool is
routed to dex-tasks too: the model sees the agent's definition, a worker runs the catalog's
code, and the local function body never runs. Any other tool that would run code in the agent
process (the agent's own, or one another capability contributes) would bypass dex-tasks, so the
run stops at its first step with a :class:`~dex_tasks.ConfigurationError` naming it, unless it
is listed in ``local_tools=`` (it then runs in the agent process, as before). Pydantic AI's own
typed tools (tool search, capability loading), output tools and external tools are left alone.

**The idempotency key** without ``session_id`` (``session/turn/call``) is built only from what
the message history keeps, so a run resumed in another process from the saved history finds the
same calls:

* session: the Pydantic AI conversation id of the response that
  holds the call (``agent.run(..., conversation_id="ticket-42")`` chooses it; Pydantic AI stores
  it on every message and a resumed run inherits it). Not ``run_id`` (what pydantic-ai PR
  #7531 proposed keying on): a resumed run gets a new one.
* turn: the model response's ``provider_response_id``; when the model gives none (the offline
  ``TestModel`` and ``FunctionModel`` do not), a hash of the response's timestamp and tool calls,
  which the saved history keeps exactly. Not the response's position in the history: trimming or
  summarising old messages would move it and give an old call a new key.
* call: the model's tool-call id. Fake models that reuse ids across turns get distinct keys,
  because the turn differs.

An id dex-tasks would refuse (``/``, over 200 characters) is shortened deterministically: a
readable prefix and a hash of the whole id.

**Approvals.** A call whose policy needs approval is recorded ``awaiting_approval`` and the tool
raises Pydantic AI's ``ApprovalRequired``: the run ends with ``DeferredToolRequests`` (so the
agent's ``output_type`` must include it), whose ``metadata[tool_call_id]`` carries ``dex_key``,
``dex_session_id`` and ``dex_interrupt_id``. Save ``result.all_messages()`` and exit; a person
decides with ``resolve_interrupt``; a new process loads the history and resumes with
``deferred_tool_results=await dex.deferred_results(history)`` (or
:func:`dex_deferred_results`). An approved call is answered ``ToolApproved`` and runs through
dex-tasks under its key, so it runs once however often the resume is replayed; a rejected one is
answered ``ToolDenied`` with the call's error (``APPROVAL_REJECTED ...`` and the person's
message), which the model reads as the tool's result. A ``ToolApproved`` is never taken on
trust (pydantic-ai issue #5536): the call goes back to dex-tasks, whose record decides (a call
dex-tasks still holds is deferred again; one it rejected returns its rejection). A tool the
agent itself marks ``requires_approval=True`` is deferred by Pydantic AI before dex-tasks sees
the call: answer that approval as before (``dex_deferred_results`` leaves calls dex-tasks does
not know out); dex-tasks' policy then applies as well.

**Edits.** A person may approve with edited arguments in dex-tasks (``resolve_interrupt(...,
arguments=...)``, the page's edit box) or in your own approval UI the Pydantic AI way,
``ToolApproved(override_args={...})``: hand those decisions to dex-tasks with
``await dex.apply_decisions(requests, decisions, approver="alice")`` (or
:func:`dex_apply_decisions`), which records each as ``resolve_interrupt`` would (an edit is
checked against the tool's schema) and returns what to resume with. An edited call is answered
``ToolApproved(override_args=<the edited arguments>)``; the tool runs once with them under the
call's key, and the model reads its result with a note beside it (``ToolReturn.content``) that
says which arguments were changed.

**Results.** A call that succeeded returns its result to the model. A call that failed, was
rejected or ended ``outcome_unknown`` raises Pydantic AI's ``ToolFailed`` with the call's
error, which the model reads as a failed tool result (the error says whether the tool ran). A
call still unfinished after ``timeout`` seconds is deferred (``CallDeferred``, with the same
metadata) rather than abandoned: it keeps running on its worker, and resuming waits for it
under the same key.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from dex_tasks.integrations.extras import needs_extra

with needs_extra("pydantic-ai", "dex_tasks.integrations.pydantic_ai"):
    from pydantic_ai import (
        ApprovalRequired,
        CallDeferred,
        DeferredToolRequests,
        DeferredToolResults,
        ModelMessage,
        ModelRequest,
        ModelResponse,
        RunContext,
        ToolApproved,
        ToolDefinition,
        ToolDenied,
        ToolFailed,
        ToolReturn,
        UserPromptPart,
    )
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.capabilities.abstract import WrapModelRequestHandler, WrapRunHandler
    from pydantic_ai.messages import ModelMessagesTypeAdapter, RetryPromptPart, ToolReturnPart
    from pydantic_ai.models import ModelRequestContext
    from pydantic_ai.run import AgentRunResult
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

from pydantic_core import SchemaValidator, core_schema, to_jsonable_python

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallNotFoundError,
    CallStatus,
    ConfigurationError,
    DexClient,
    DexError,
    EffectClass,
    InvalidArgumentError,
    ToolCallRecord,
    ToolCallRequest,
    ToolSpec,
    Turn,
    UnknownToolError,
    idempotency_key,
    key_part,
    tool_message_text,
)

__all__ = ["ApprovalPendingError", "DexCapability", "TurnInProgressError", "dex_apply_decisions",
           "dex_deferred_results"]

# Ids dex-tasks accepts (dex_tasks/limits.py): at most 200 characters, no "/".
_ID_MAX = 200
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# Catalog tools take a JSON object; the published schema is checked by dex-tasks (before a person
# is asked to approve, or by the worker), which tells the model exactly which field is wrong.
_OBJECT_ARGS = SchemaValidator(core_schema.dict_schema(keys_schema=core_schema.str_schema()))


class ApprovalPendingError(DexError):
    """Resuming was asked for while some of the paused run's calls still wait for a person.

    ``records`` are those calls (each with its ``interrupt_id``). Resume once
    ``resolve_interrupt`` (or the deadline sweep) has decided them: Pydantic AI needs an answer
    for every deferred call of the response.
    """

    def __init__(self, records: Sequence[ToolCallRecord]) -> None:
        waiting = ", ".join(f"{r.key} (interrupt {r.interrupt_id})" for r in records)
        super().__init__(f"{len(records)} tool call(s) still wait for a person's decision: "
                         f"{waiting}; resume after resolve_interrupt has decided them")
        self.records = list(records)


class TurnInProgressError(DexError):
    """A run with a new input was started on a session whose durable turn is still open.

    The input was queued as a user message of the session (delivered when that turn ends), as
    the seeds' sessions do; finish the open turn first: run its own input again (``turn``).
    """

    def __init__(self, session_id: str, turn: Turn) -> None:
        super().__init__(f"session {session_id!r} has an open turn ({turn.turn_id!r}, begun with "
                         f"{turn.input!r}): the new input was queued for after it; run the open "
                         "turn's input again to finish it")
        self.turn = turn


# -- ids ----------------------------------------------------------------------------------------


def _fit_id(value: str) -> str:
    """The dex id for a framework id: ``dex_tasks.key_part``, one-to-one."""
    return key_part(value)


def _turn_id(response: ModelResponse) -> str:
    """The id of the model response that holds a call (see the module docstring)."""
    if response.provider_response_id:
        return _fit_id(response.provider_response_id)
    stamp = response.timestamp
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    # Whole microseconds since the epoch: exact, and the same after a JSON round trip of the
    # history (an ISO string's offset notation could differ between writer and reader).
    micros = (stamp - _EPOCH) // timedelta(microseconds=1)
    calls = [[part.tool_name, part.tool_call_id] for part in response.tool_calls]
    digest = hashlib.sha256(json.dumps([micros, calls]).encode()).hexdigest()[:24]
    return f"response-{digest}"


def _holding_response(messages: Sequence[ModelMessage], tool_call_id: str) -> ModelResponse:
    # The latest response that made the call: a model that reuses tool-call ids made the earlier
    # ones in earlier responses, and the calls being run belong to the latest.
    for message in reversed(messages):
        if isinstance(message, ModelResponse) and any(
            part.tool_call_id == tool_call_id for part in message.tool_calls
        ):
            return message
    raise DexError(f"tool call {tool_call_id!r} is in no model response of the run's messages, "
                   "so its idempotency key cannot be built")


def _call_key(session_id: str | None, response: ModelResponse, tool_call_id: str,
              conversation_id: str | None = None) -> tuple[str, str, str]:
    session = session_id or response.conversation_id or conversation_id
    if not session:
        raise DexError("the model response has no conversation id and no session_id was given, "
                       "so the call has no session: pass DexCapability(session_id=...)")
    return _fit_id(session), _turn_id(response), _fit_id(tool_call_id)


def _metadata(record: ToolCallRecord) -> dict[str, Any]:
    """What a deferred call carries in ``DeferredToolRequests.metadata``."""
    return {"dex_key": record.key, "dex_session_id": record.session_id,
            "dex_interrupt_id": record.interrupt_id, "dex_tool": record.tool}


# -- durable turns ------------------------------------------------------------------------------


def _begins_turn(message: ModelMessage) -> bool:
    # A user prompt beside tool results is a tool's ToolReturn(content=...) (the edit note of
    # an edited call is one), which continues the turn; a prompt alone begins one.
    return isinstance(message, ModelRequest) and any(
        isinstance(part, UserPromptPart) for part in message.parts) and not any(
        isinstance(part, ToolReturnPart | RetryPromptPart) for part in message.parts)


def _position(messages: Sequence[ModelMessage], upto: int | None = None) -> int:
    """The step of the turn a model response at ``messages[upto]`` has (default: the next
    response, after ``messages``): how many responses follow the turn's user prompt."""
    end = len(messages) if upto is None else upto
    position = 0
    for message in messages[:end]:
        if _begins_turn(message):
            position = 0
        elif isinstance(message, ModelResponse):
            position += 1
    return position


def _step_call_id(position: int, tool_call_id: str) -> str:
    """The dex tool-call id of a model's call in step ``position`` of a durable turn. The step
    is part of it because fake models reuse call ids from one response to the next; both
    come from the journaled response, so a replay gives the same keys."""
    return _fit_id(f"{position}.{tool_call_id}")


def _input_text(prompt: object, messages: Sequence[ModelMessage]) -> str:
    """The input that begins (or continues) a run's turn: the run's user prompt, else the last
    user prompt of the history it resumes."""
    if prompt is None:
        for message in reversed(messages):
            if isinstance(message, ModelRequest) and _begins_turn(message):
                parts = [p for p in message.parts if isinstance(p, UserPromptPart)]
                if parts:
                    prompt = parts[-1].content
                    break
    if prompt is None:
        raise DexError("a durable turn needs an input: the run has no user prompt and its "
                       "message history none either")
    if isinstance(prompt, str):
        return prompt
    return json.dumps(to_jsonable_python(prompt), sort_keys=True)


def _dump(response: ModelResponse) -> str:
    return ModelMessagesTypeAdapter.dump_json([response]).decode()


def _load(text: str) -> ModelResponse:
    [message] = ModelMessagesTypeAdapter.validate_json(text)
    if not isinstance(message, ModelResponse):
        raise DexError("a journaled step holds no Pydantic AI model response")
    return message


def _text_of(response: ModelResponse) -> str | None:
    return response.text or None


def _answer_text(output: object) -> str:
    if isinstance(output, str) and output.strip():
        return output
    return json.dumps(to_jsonable_python(output), sort_keys=True)


@dataclass
class _Journal:
    """One run's durable turn: where its steps go, and the calls of the latest step."""

    session_id: str
    turn: Turn
    # The records of the latest step's calls, by the model's tool-call id.
    records: dict[str, ToolCallRecord] = field(default_factory=dict)
    # A response without tool calls, journaled only if the run asks the model again (a retry):
    # the final answer is the turn's end instead (end_turn), not a step.
    held: tuple[int, ModelResponse] | None = None


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
        self.session_id = None if session_id is None else _fit_id(session_id)
        self.local_tools = frozenset(local_tools)
        self.timeout = float(timeout)
        self.default_effect = default_effect
        self.id = id

        self._catalog = _RunCatalog()
        self._journal: _Journal | None = None

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
        text = _input_text(ctx.prompt, ctx.messages)
        turn = await self.client.begin_turn(self.session_id, text)
        if turn.queued_input:
            raise TurnInProgressError(self.session_id, turn)
        self._journal = _Journal(self.session_id, turn)
        result: AgentRunResult[Any] = await handler()
        if not isinstance(result.output, DeferredToolRequests):
            held = self._journal.held
            await self.client.end_turn(self.session_id, turn.turn_id, _answer_text(result.output),
                                       response=None if held is None else _dump(held[1]))
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
        position = _position(request_context.messages)
        turn = journal.turn
        if journal.held is not None and journal.held[0] < position:
            # The model is asked again after a response without tools (an output retry):
            # that response was a step after all.
            held_at, held = journal.held
            journal.held = None
            await self._record(journal, held_at, held)
        step = turn.step(position)
        if step is not None:
            response = _load(step.response)
            journal.records = {}
            by_id = {record.tool_call_id: record for record in step.calls}
            for part in response.tool_calls:
                record = by_id.get(_step_call_id(position, part.tool_call_id))
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

    async def _record(self, journal: _Journal, position: int, response: ModelResponse) -> None:
        """Journal ``response`` as step ``position`` with its calls of catalog tools."""
        catalog = await self._catalog_tools()
        requests = [ToolCallRequest(tool_call_id=_step_call_id(position, part.tool_call_id),
                                    tool=part.tool_name,
                                    arguments=to_jsonable_python(part.args_as_dict()))
                    for part in response.tool_calls if part.tool_name in catalog]
        records = await self.client.record_step(
            journal.session_id, journal.turn.turn_id, position, _dump(response), requests,
            text=_text_of(response), default_effect=self.default_effect)
        by_id = {record.tool_call_id: record for record in records}
        journal.records = {part.tool_call_id: by_id[_step_call_id(position, part.tool_call_id)]
                           for part in response.tool_calls
                           if _step_call_id(position, part.tool_call_id) in by_id}

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
            raise ApprovalRequired(metadata=_metadata(record))
        try:
            record = await self.client.wait(record.key, timeout=self.timeout)
        except TimeoutError:
            # Still queued or running on a worker: pause the run instead of giving up on the
            # call; resuming enters here again with the same key and waits for the same call.
            raise CallDeferred(metadata=_metadata(record)) from None
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
        response = _holding_response(ctx.messages, ctx.tool_call_id)
        journal = self._journal
        if journal is not None:
            at = max(i for i, m in enumerate(ctx.messages) if m is response)
            session, turn = journal.session_id, journal.turn.turn_id
            call = _step_call_id(_position(ctx.messages, at), ctx.tool_call_id)
        else:
            session, turn, call = _call_key(self.session_id, response, ctx.tool_call_id,
                                            ctx.conversation_id)
        try:
            return await self.client.call_tool(
                session_id=session, turn_id=turn, tool_call_id=call, tool=tool,
                arguments=to_jsonable_python(arguments), default_effect=self.default_effect,
            )
        except UnknownToolError as err:
            # Unpublished since this run read the catalog: nothing ran, the model can adapt.
            raise ToolFailed(f"{TOOL_DID_NOT_RUN}: {err}") from None


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
    aclient = _async(client)
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


def _async(client: DexClient | AsyncDexClient) -> AsyncDexClient:
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
            fitted = None if session_id is None else _fit_id(session_id)
            # With a session, the capability ran a durable turn: the calls are keyed by the
            # open turn and the step of the response that holds them.
            turn = None if fitted is None else await aclient.open_turn(fitted)
            for call_id in call_ids:
                if fitted is not None and turn is not None:
                    at = max(i for i, m in enumerate(paused) if m is response)
                    keys[call_id] = idempotency_key(
                        fitted, turn.turn_id, _step_call_id(_position(paused, at), call_id))
                else:
                    keys[call_id] = idempotency_key(*_call_key(fitted, response, call_id))
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
    aclient = _async(client)
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
