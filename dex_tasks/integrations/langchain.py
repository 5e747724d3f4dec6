"""LangChain / LangGraph: every tool call of a ``create_agent`` agent runs through dex-tasks.

    from dex_tasks import DexClient
    from dex_tasks.integrations.langchain import DexMiddleware, dex_tools

    client = DexClient.from_env()
    agent = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                         checkpointer=checkpointer)

:class:`DexMiddleware` sends each tool call the model makes to ``client.call_tool`` and waits
for its record; the tool itself runs on a dex-tasks worker. :func:`dex_tools` builds LangChain
tools from the catalog the workers published (the JSON schema of each tool's arguments, its
docstring as the description), so the agent process need not import any tool code. An agent
that keeps its own LangChain tools adds only the middleware: the workers must serve tools of the
same names.

Idempotency keys come from ids LangGraph keeps in the checkpoint: the session is the thread id,
the turn is the id of the AI message that holds the call, and the call is the model's tool-call
id. LangGraph re-runs a node from its start when a run resumes, is replayed from a checkpoint,
or is re-invoked after a crash; the same ids give the same key, so the tool does not start
again: the node reads the call's record instead. (A fake model that reuses tool-call ids across
turns does not collide either, since each turn is its own AI message.)

A call that needs approval pauses the graph with LangGraph's ``interrupt()``, whose value is
the dex interrupt: ``{"type": "dex_approval", "interrupt_id", "session_id", "key", "tool",
"arguments", "effect", "tool_call_id"}``. The agent process may exit. Once someone has called
``resolve_interrupt`` (Python, the CLI, the HTTP API or the approval page), any process with the
same checkpointer resumes the graph::

    agent.invoke(resume_command(agent.get_state(config)), config)

The resume value only wakes the graph up: the decision recorded in dex-tasks is the one that
counts, so a forged or stale resume value approves nothing (the graph pauses again while the
call is undecided). A rejection reaches the model as the tool's result, carrying the person's
message.

A tool node that has waited ``wait_timeout`` seconds raises ``TimeoutError``; invoking the
graph again (``agent.invoke(None, config)``) re-runs the node, which waits for the same call.
Pass ``durability="sync"`` to ``invoke`` where a crash must never re-run the model: with
LangGraph's default (``"async"``) the checkpoint holding the model's answer is written while
the tools already run, so a process killed in those milliseconds re-asks the model, and its
new answer's calls are new calls (``"exit"`` widens that window to the whole run).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, cast

from dex_tasks.integrations.extras import needs_extra

with needs_extra("langchain", "dex_tasks.integrations.langchain"):
    from langchain.agents.middleware import AgentMiddleware, AgentState, ToolCallRequest
    from langchain_core.callbacks.manager import AsyncCallbackManager, CallbackManager
    from langchain_core.messages import AIMessage, ToolCall, ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import BaseTool, StructuredTool
    from langgraph.checkpoint.base import (
        WRITES_IDX_MAP,
        BaseCheckpointSaver,
        ChannelVersions,
        Checkpoint,
        CheckpointMetadata,
        CheckpointTuple,
        get_checkpoint_id,
        get_checkpoint_metadata,
    )
    from langgraph.checkpoint.serde.base import SerializerProtocol
    from langgraph.prebuilt import ToolRuntime
    from langgraph.types import Command, StateSnapshot, interrupt

from dex_tasks import (
    AsyncDexClient,
    CallStatus,
    DexClient,
    EffectClass,
    InvalidArgumentError,
    InvalidCallError,
    ToolCallRecord,
    ToolSpec,
    UnknownToolError,
    key_part,
    tool_message_text,
)

__all__ = [
    "DEX_APPROVAL",
    "DexCheckpointer",
    "DexMiddleware",
    "apply_decisions",
    "dex_tools",
    "key_part",
    "resume_command",
]

DEX_APPROVAL = "dex_approval"
"""The ``type`` of every interrupt value this adapter raises."""

DEFAULT_WAIT_TIMEOUT = 300.0
"""Seconds a tool node waits for a call's result before it raises ``TimeoutError``."""


@dataclass(frozen=True)
class _CallIds:
    session_id: str
    turn_id: str
    tool_call_id: str
    # Every call of the AI message holding this one: the model response's parallel calls.
    siblings: tuple[ToolCall, ...] = ()


def _call_ids(call: ToolCall, state: Any, config: RunnableConfig) -> _CallIds:
    """session = the thread id, turn = the AI message holding the call, call = its id."""
    thread_id = (config.get("configurable") or {}).get("thread_id")
    if thread_id is None or thread_id == "":
        raise InvalidCallError(
            "dex_tasks.integrations.langchain needs a thread id (it is the dex session): "
            "invoke the agent with config={'configurable': {'thread_id': ...}} and give it a "
            "checkpointer"
        )
    call_id = call.get("id")
    if not call_id:
        raise InvalidCallError(
            f"the model's call of tool {call['name']!r} has no id: dex-tasks keys each call "
            "by its tool-call id"
        )
    message = _message_holding(call_id, _messages_of(state))
    if message is None or not message.id:
        raise InvalidCallError(
            f"no AI message with an id in the graph state holds tool call {call_id!r}: its "
            "id is the dex turn id"
        )
    return _CallIds(key_part(str(thread_id)), key_part(message.id), key_part(call_id),
                    tuple(message.tool_calls))


def _messages_of(state: Any) -> Sequence[Any]:
    if isinstance(state, dict):
        return state.get("messages") or ()
    if isinstance(state, list):
        return state
    return getattr(state, "messages", None) or ()


def _message_holding(call_id: str, messages: Sequence[Any]) -> AIMessage | None:
    # Newest first: a model that reuses tool-call ids across turns reuses them in older
    # messages, and the tool node only ever runs the calls of the latest one.
    for message in reversed(messages):
        if isinstance(message, AIMessage) and any(
            c.get("id") == call_id for c in message.tool_calls
        ):
            return message
    return None


def _interrupt_value(record: ToolCallRecord, call: ToolCall) -> dict[str, Any]:
    return {
        "type": DEX_APPROVAL,
        "interrupt_id": record.interrupt_id,
        "session_id": record.session_id,
        "key": record.key,
        "tool": record.tool,
        "arguments": record.arguments,
        "effect": record.effect.value,
        "tool_call_id": call.get("id"),
    }


def _tool_message(record: ToolCallRecord, call: ToolCall) -> ToolMessage:
    """What the model reads: the result, or the error (a rejection carries the person's
    message; a call that never reached the tool says it is safe to call again)."""
    if record.status is CallStatus.SUCCEEDED:
        result = record.result
        content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        status = "success"
    else:
        content = record.error or f"the tool call ended {record.status.value}"
        status = "error"
    return ToolMessage(
        content=tool_message_text(record, content),  # the edit note first, if edited
        tool_call_id=call.get("id") or "",
        name=call["name"],
        status=status,
        artifact={"key": record.key, "status": record.status.value},
    )


def _unknown_tool_message(call: ToolCall, err: UnknownToolError) -> ToolMessage:
    return ToolMessage(content=f"Error: {err}", tool_call_id=call.get("id") or "",
                       name=call["name"], status="error")


class _Runner:
    """Runs one model tool call through dex-tasks, from a sync or an async graph."""

    def __init__(
        self,
        client: DexClient | AsyncDexClient,
        wait_timeout: float,
        default_effect: EffectClass | str | None,
        local_tools: Iterable[str | BaseTool] = (),
    ) -> None:
        if isinstance(client, AsyncDexClient):
            self.sync: DexClient = client.sync
            self._async: AsyncDexClient | None = client
        elif isinstance(client, DexClient):
            self.sync = client
            self._async = None
        else:
            raise InvalidArgumentError(
                f"client must be a DexClient or an AsyncDexClient, got {type(client).__name__}"
            )
        if isinstance(wait_timeout, bool) or not isinstance(wait_timeout, int | float) \
                or wait_timeout <= 0:
            raise InvalidArgumentError(f"wait_timeout must be a positive number of seconds, "
                                       f"got {wait_timeout!r}")
        self.wait_timeout = float(wait_timeout)
        self.default_effect = default_effect
        if isinstance(local_tools, str):
            raise InvalidArgumentError(f"local_tools must be a list of tools or tool names, "
                                       f"got the string {local_tools!r}")
        self.local_tools = frozenset(t if isinstance(t, str) else t.name for t in local_tools)
        # LangGraph runs a step's tool calls in threads: create the client's Celery app now,
        # as DexClient.app would lazily, so that two threads never race to build two.
        _ = self.sync.app

    @property
    def aclient(self) -> AsyncDexClient:
        if self._async is None:
            self._async = AsyncDexClient(client=self.sync)
        return self._async

    def batch(self, ids: _CallIds) -> list[dict[str, Any]]:
        """The dex calls of the model response holding a call (its local tools left out)."""
        return [{"tool_call_id": key_part(str(c["id"])), "tool": c["name"], "arguments": c["args"]}
                for c in ids.siblings if c.get("id") and c["name"] not in self.local_tools]

    def record(self, call: ToolCall, ids: _CallIds) -> ToolCallRecord:
        """The call's record, the response's parallel calls recorded with it.

        LangGraph runs a response's calls one node task each, in parallel: the first to get
        here records all of them in one transaction and starts them with one publish
        (``call_tools``); the others find them recorded. A response naming a tool no worker
        serves is recorded call by call, so that only that call is answered as unknown.
        """
        batch = self.batch(ids)
        if len(batch) > 1:
            try:
                records = self.sync.call_tools(batch, session_id=ids.session_id,
                                               turn_id=ids.turn_id,
                                               default_effect=self.default_effect)
            except UnknownToolError:
                pass
            else:
                for record in records:
                    if record.tool_call_id == ids.tool_call_id:
                        return record
        return self.sync.call_tool(
            session_id=ids.session_id, turn_id=ids.turn_id, tool_call_id=ids.tool_call_id,
            tool=call["name"], arguments=call["args"], default_effect=self.default_effect,
        )

    def run(self, call: ToolCall, state: Any, config: RunnableConfig) -> ToolMessage:
        ids = _call_ids(call, state, config)
        record = self.record(call, ids)
        # The first pass pauses the graph here. A resumed (re-run) node gets the same record
        # back from call_tool; if it is still undecided, the resume value was premature or
        # forged: interrupt again, which pauses the graph anew.
        while record.status is CallStatus.AWAITING_APPROVAL:
            interrupt(_interrupt_value(record, call))
            record = self.sync.get_tool_call(record.key)
        if not record.terminal:
            record = self._wait(record.key)
        return _tool_message(record, call)

    async def arun(self, call: ToolCall, state: Any, config: RunnableConfig) -> ToolMessage:
        ids = _call_ids(call, state, config)
        client = self.aclient
        record = await asyncio.to_thread(self.record, call, ids)
        while record.status is CallStatus.AWAITING_APPROVAL:  # see run()
            interrupt(_interrupt_value(record, call))
            record = await client.get_tool_call(record.key)
        if not record.terminal:
            try:
                record = await client.wait(record.key, self.wait_timeout)
            except TimeoutError as err:
                raise _still_running(record.key, self.wait_timeout) from err
        return _tool_message(record, call)

    def _wait(self, key: str) -> ToolCallRecord:
        try:
            return self.sync.wait(key, self.wait_timeout)
        except TimeoutError as err:
            raise _still_running(key, self.wait_timeout) from err


def _still_running(key: str, timeout: float) -> TimeoutError:
    # Raised rather than told to the model: the call is still going and will end on its own.
    # Re-invoking the graph (agent.invoke(None, config)) re-runs the tool node, which finds
    # the same call by its key and waits again; nothing runs twice.
    return TimeoutError(
        f"tool call {key!r} has not ended after {timeout}s; invoke the agent again with the "
        "same thread id (agent.invoke(None, config)) to keep waiting: the call will not run "
        "twice"
    )


class DexMiddleware(AgentMiddleware[AgentState[Any], Any, Any]):
    """Runs every tool call of a ``langchain.agents.create_agent`` agent through dex-tasks.

    ``create_agent(model, tools, middleware=[DexMiddleware(client)], checkpointer=...)``: each
    call the model makes is recorded with ``client.call_tool`` under the key
    ``thread id / AI message id / tool-call id`` and run by a worker; the tool node waits up to
    ``wait_timeout`` seconds for its result, which becomes the ``ToolMessage`` the model reads
    (a failure, a rejection or an unknown outcome becomes an error ``ToolMessage`` with the
    call's error). A call that needs approval pauses the graph with ``interrupt()``; resume it
    with :func:`resume_command` once the call is decided. ``default_effect`` is the session's
    default effect class for tools with neither a policy nor MCP hints.

    The agent's own tools (if any) only tell the model what it may call; their code is not run
    in the agent process, except the tools named in ``local_tools`` (tools or names), which run
    in the agent process as LangGraph runs them, without dex-tasks: a calculator, a tool
    outside the catalog. A call of a tool the agent does not have and the workers do not serve
    is answered with an error ``ToolMessage``, as LangGraph answers an unknown tool name.

    Each dex call is reported to LangChain's callbacks as a tool run (``on_tool_start`` /
    ``on_tool_end``, so ``astream_events`` shows it), and one model response's parallel
    calls are recorded in one transaction and sent with one publish (``call_tools``).
    """

    def __init__(
        self,
        client: DexClient | AsyncDexClient,
        *,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        default_effect: EffectClass | str | None = None,
        local_tools: Iterable[str | BaseTool] = (),
    ) -> None:
        super().__init__()
        self._runner = _Runner(client, wait_timeout, default_effect, local_tools)

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        """Run the call through dex-tasks (``handler``, the in-process tool, is called only for
        ``local_tools``)."""
        call = request.tool_call
        if call["name"] in self._runner.local_tools:
            return handler(request)
        config = request.runtime.config
        events = CallbackManager.configure(
            inheritable_callbacks=config.get("callbacks"), inheritable_tags=config.get("tags"),
            inheritable_metadata=config.get("metadata"))
        run = events.on_tool_start({"name": call["name"]}, json.dumps(call["args"], default=str),
                                   name=call["name"], inputs=call["args"],
                                   tool_call_id=call.get("id"))
        try:
            message = self._runner.run(call, request.state, config)
        except UnknownToolError as err:
            if request.tool is not None:
                run.on_tool_error(err)
                raise  # the agent has the tool but no worker serves it: a deployment error
            message = _unknown_tool_message(call, err)
        except (Exception, KeyboardInterrupt) as err:  # as BaseTool.run reports it
            run.on_tool_error(err)
            raise
        run.on_tool_end(message)
        return message

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """The async form of :meth:`wrap_tool_call`, for ``ainvoke``, ``astream`` and
        ``astream_events``."""
        call = request.tool_call
        if call["name"] in self._runner.local_tools:
            return await handler(request)
        config = request.runtime.config
        events = AsyncCallbackManager.configure(
            inheritable_callbacks=config.get("callbacks"), inheritable_tags=config.get("tags"),
            inheritable_metadata=config.get("metadata"))
        run = await events.on_tool_start(
            {"name": call["name"]}, json.dumps(call["args"], default=str), name=call["name"],
            inputs=call["args"], tool_call_id=call.get("id"))
        try:
            message = await self._runner.arun(call, request.state, config)
        except UnknownToolError as err:
            if request.tool is not None:
                await run.on_tool_error(err)
                raise
            message = _unknown_tool_message(call, err)
        except (Exception, KeyboardInterrupt) as err:
            await run.on_tool_error(err)
            raise
        await run.on_tool_end(message)
        return message


def dex_tools(
    client: DexClient | AsyncDexClient,
    names: Iterable[str] | None = None,
    *,
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    default_effect: EffectClass | str | None = None,
) -> list[BaseTool]:
    """LangChain tools for the tools the workers published (all of them, or ``names``).

    Each is a ``StructuredTool`` whose argument schema is the tool's published JSON schema and
    whose description is its docstring, so the agent process needs none of the tools' code.
    Under :class:`DexMiddleware` the middleware runs their calls; in a graph without it (a
    LangGraph ``ToolNode``), each tool runs its call through dex-tasks itself, the same way and
    under the same key. Raises :class:`UnknownToolError` for a name no worker published.
    """
    runner = _Runner(client, wait_timeout, default_effect)
    specs = {spec.name: spec for spec in runner.sync.list_tools(default_effect)}
    if names is None:
        chosen = list(specs.values())
    else:
        if isinstance(names, str):
            raise InvalidArgumentError(f"names must be a list of tool names, got the string "
                                       f"{names!r}")
        chosen = []
        for name in names:
            if name not in specs:
                raise UnknownToolError(name)
            chosen.append(specs[name])
    return [_structured_tool(spec, runner) for spec in chosen]


def _structured_tool(spec: ToolSpec, runner: _Runner) -> StructuredTool:
    def call_of(runtime: ToolRuntime | None, arguments: dict[str, Any]) -> ToolCall:
        if runtime is None or not runtime.tool_call_id:
            raise InvalidCallError(
                f"dex tool {spec.name!r} runs inside a LangGraph graph, called by a model: "
                "its key comes from the thread id, the AI message and the tool-call id"
            )
        return ToolCall(name=spec.name, args=arguments, id=runtime.tool_call_id,
                        type="tool_call")

    # LangGraph's ToolNode injects ``runtime`` (it looks for a parameter of that name); the
    # model's arguments arrive as keywords, unchecked here: the worker checks them against
    # the schema (and call_tool does, before anyone is asked to approve).
    def run(runtime: ToolRuntime | None = None, **arguments: Any) -> ToolMessage:
        call = call_of(runtime, arguments)
        assert runtime is not None
        return runner.run(call, runtime.state, runtime.config)

    async def arun(runtime: ToolRuntime | None = None, **arguments: Any) -> ToolMessage:
        call = call_of(runtime, arguments)
        assert runtime is not None
        return await runner.arun(call, runtime.state, runtime.config)

    return StructuredTool(
        name=spec.name,
        description=spec.description or spec.name,
        args_schema=spec.parameters,
        func=run,
        coroutine=arun,
        metadata={"dex_effect": spec.policy.effect.value,
                  "dex_needs_approval": spec.policy.needs_approval},
    )


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


# -- the checkpointer -------------------------------------------------------------------------


class DexCheckpointer(BaseCheckpointSaver[str]):
    """LangGraph's checkpointer on the dex store (SQLite or PostgreSQL), so that an agent
    needs no second database: ``create_agent(..., checkpointer=DexCheckpointer(client))``.

    Checkpoints and pending writes are serialised by LangGraph's serializer (``serde``, its
    default unless given) into ``dex_checkpoints`` and ``dex_checkpoint_writes``; every write
    is retried across a lost connection like the store's own. The async methods run the same
    code in a thread. Any process with a client on the same store resumes the thread.
    """

    def __init__(self, client: DexClient | AsyncDexClient, *,
                 serde: SerializerProtocol | None = None) -> None:
        super().__init__(serde=serde)
        sync = _sync_client(client)
        self._store = sync.checkpoints

    # -- sync ---------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (its ``checkpoint_id``), else the thread's newest."""
        conf = config["configurable"]
        found = self._store.get(str(conf["thread_id"]), conf.get("checkpoint_ns", ""),
                                get_checkpoint_id(config))
        return None if found is None else self._tuple(found)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None,
             limit: int | None = None) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first: of ``config``'s thread (and namespace, if given), whose
        metadata has ``filter``'s values, older than ``before``, at most ``limit``."""
        conf = (config or {}).get("configurable") or {}
        thread_id = conf.get("thread_id")
        found = self._store.list(
            thread_id=None if thread_id is None else str(thread_id),
            checkpoint_ns=conf.get("checkpoint_ns"),
            checkpoint_id=get_checkpoint_id(config) if config else None,
            before=get_checkpoint_id(before) if before else None,
            limit=limit, metadata_filter=filter)
        for stored in found:
            yield self._tuple(stored)

    def put(self, config: RunnableConfig, checkpoint: Checkpoint,
            metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        """Save a checkpoint; returns the config that names it."""
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        checkpoint_ns = conf.get("checkpoint_ns", "")
        type_, blob = self.serde.dumps_typed(checkpoint)
        self._store.put(thread_id, checkpoint_ns, checkpoint["id"], conf.get("checkpoint_id"),
                        type_, blob, get_checkpoint_metadata(config, metadata))
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns,
                                 "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                   task_id: str, task_path: str = "") -> None:
        """Save a task's writes against the checkpoint ``config`` names."""
        conf = config["configurable"]
        stored = [(WRITES_IDX_MAP.get(channel, idx), channel, *self.serde.dumps_typed(value))
                  for idx, (channel, value) in enumerate(writes)]
        self._store.put_writes(str(conf["thread_id"]), conf.get("checkpoint_ns", ""),
                               str(conf["checkpoint_id"]), task_id, task_path, stored)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread."""
        self._store.delete_thread(str(thread_id))

    def get_next_version(self, current: str | None, channel: None) -> str:
        """LangGraph's string versions (as its SQLite and in-memory savers make them)."""
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # -- async: the same, in a thread -------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple` in a thread."""
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *,
                    filter: dict[str, Any] | None = None, before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        """:meth:`list` in a thread."""
        found = await asyncio.to_thread(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit)))
        for item in found:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        """:meth:`put` in a thread."""
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        """:meth:`put_writes` in a thread."""
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread` in a thread."""
        await asyncio.to_thread(self.delete_thread, thread_id)

    def _tuple(self, stored: Any) -> CheckpointTuple:
        # ``stored``: a dex_tasks.store.checkpoints.StoredCheckpoint
        ids = {"thread_id": stored.thread_id, "checkpoint_ns": stored.checkpoint_ns}
        return CheckpointTuple(
            config={"configurable": {**ids, "checkpoint_id": stored.checkpoint_id}},
            checkpoint=self.serde.loads_typed((stored.type or "", stored.checkpoint)),
            metadata=cast(CheckpointMetadata, stored.metadata),
            parent_config=({"configurable": {**ids,
                                             "checkpoint_id": stored.parent_checkpoint_id}}
                           if stored.parent_checkpoint_id else None),
            pending_writes=[(w.task_id, w.channel,
                             self.serde.loads_typed((w.type or "", w.value or b"")))
                            for w in stored.writes],
        )


def _sync_client(client: DexClient | AsyncDexClient) -> DexClient:
    if isinstance(client, AsyncDexClient):
        return client.sync
    if isinstance(client, DexClient):
        return client
    raise InvalidArgumentError(
        f"client must be a DexClient or an AsyncDexClient, got {type(client).__name__}")
