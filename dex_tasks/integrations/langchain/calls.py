"""One model tool call run through dex-tasks from a LangGraph tool node: its key from the
ids LangGraph keeps, its record, its approval pause, and the ``ToolMessage`` the model reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, ToolCall, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.types import interrupt

from dex_tasks import (
    AsyncDexClient,
    CallStatus,
    DexClient,
    EffectClass,
    InvalidArgumentError,
    InvalidCallError,
    ToolCallRecord,
    UnknownToolError,
    key_part,
    tool_message_text,
)

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


def tool_message(record: ToolCallRecord, call: ToolCall) -> ToolMessage:
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


def unknown_tool_message(call: ToolCall, err: UnknownToolError) -> ToolMessage:
    return ToolMessage(content=f"Error: {err}", tool_call_id=call.get("id") or "",
                       name=call["name"], status="error")


class Runner:
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
        return tool_message(record, call)

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
        return tool_message(record, call)

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
