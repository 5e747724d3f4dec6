"""Pydantic AI: every tool call of an agent runs through dex-tasks; approvals are deferred tools.

The lines a user adds (``pip install "dex-tasks[pydantic-ai]"``)::

    from dex_tasks import DexClient
    from dex_tasks.integrations.pydantic_ai import DexCapability
    dex = DexCapability(DexClient.from_env())
    agent = Agent(model, capabilities=[dex], output_type=[str, DeferredToolRequests])
    results = await dex.deferred_results(history)  # on resume: deferred_tool_results=results

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

**The idempotency key** ``session/turn/call`` is built only from what the message history keeps,
so a run resumed in another process from the saved history finds the same calls:

* session: ``session_id=`` if given, else the Pydantic AI conversation id of the response that
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

**Results.** A call that succeeded returns its result to the model. A call that failed, was
rejected or ended ``outcome_unknown`` raises Pydantic AI's ``ToolFailed`` with the call's
error, which the model reads as a failed tool result (the error says whether the tool ran). A
call still unfinished after ``timeout`` seconds is deferred (``CallDeferred``, with the same
metadata) rather than abandoned: it keeps running on its worker, and resuming waits for it
under the same key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

try:
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
    )
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'dex_tasks.integrations.pydantic_ai needs the pydantic-ai extra: '
        'pip install "dex-tasks[pydantic-ai]"'
    ) from err

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
    ToolSpec,
    UnknownToolError,
    idempotency_key,
    key_part,
)

__all__ = ["ApprovalPendingError", "DexCapability", "dex_deferred_results"]

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
    catalog: _RunCatalog = field(default_factory=_RunCatalog, kw_only=True)

    async def _catalog(self) -> dict[str, ToolSpec]:
        if self.catalog.tools is None:
            specs = await self.capability.client.list_tools(self.capability.default_effect)
            self.catalog.tools = {spec.name: spec for spec in specs}
        return self.catalog.tools

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

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds a client: not part of an agent spec

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        """Wrap the agent's assembled toolset, once per run (the catalog is read per run)."""
        return _DexToolset(toolset, capability=self)

    async def deferred_results(
        self, paused: DeferredToolRequests | Sequence[ModelMessage]
    ) -> DeferredToolResults:
        """The answers dex-tasks recorded for a paused run; see :func:`dex_deferred_results`."""
        return await dex_deferred_results(self.client, paused, session_id=self.session_id)

    async def _run(self, ctx: RunContext[Any], tool: str, arguments: dict[str, Any]) -> Any:
        """One tool call through dex-tasks: record it (or find it), then wait for its end."""
        if ctx.tool_call_id is None:
            raise DexError(f"Pydantic AI called {tool!r} without a tool_call_id")
        response = _holding_response(ctx.messages, ctx.tool_call_id)
        session, turn, call = _call_key(self.session_id, response, ctx.tool_call_id,
                                        ctx.conversation_id)
        try:
            record = await self.client.call_tool(
                session_id=session, turn_id=turn, tool_call_id=call, tool=tool,
                arguments=to_jsonable_python(arguments), default_effect=self.default_effect,
            )
        except UnknownToolError as err:
            # Unpublished since this run read the catalog: nothing ran, the model can adapt.
            raise ToolFailed(f"{TOOL_DID_NOT_RUN}: {err}") from None
        if record.status is CallStatus.AWAITING_APPROVAL:
            raise ApprovalRequired(metadata=_metadata(record))
        try:
            record = await self.client.wait(record.key, timeout=self.timeout)
        except TimeoutError:
            # Still queued or running on a worker: pause the run instead of giving up on the
            # call; resuming enters here again with the same key and waits for the same call.
            raise CallDeferred(metadata=_metadata(record)) from None
        if record.status is CallStatus.SUCCEEDED:
            return record.result
        raise ToolFailed(record.error or f"the tool call ended {record.status.value}")


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
    aclient = client if isinstance(client, AsyncDexClient) else AsyncDexClient(client=client)
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
            for call_id in call_ids:
                keys[call_id] = idempotency_key(*_call_key(fitted, response, call_id))

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
            results.approvals[call_id] = ToolApproved()
    if waiting:
        raise ApprovalPendingError(waiting)
    return results
