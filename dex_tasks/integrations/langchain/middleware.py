"""``DexMiddleware``: every tool call of a ``create_agent`` agent through dex-tasks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ToolCallRequest, hook_config
from langchain_core.callbacks.manager import AsyncCallbackManager, CallbackManager
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.types import Command

from dex_tasks import AsyncDexClient, DexClient, EffectClass, UnknownToolError
from dex_tasks.integrations.langchain.calls import (
    DEFAULT_WAIT_TIMEOUT,
    Runner,
    unknown_tool_message,
)
from dex_tasks.integrations.langchain.queue import QueueState, deliver_held, hold_new_input


class DexMiddleware(AgentMiddleware[QueueState, Any, Any]):
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

    A new input given while the thread's turn is open (``agent.invoke({"messages": [...]},
    config)`` while a call awaits a person, say) is held until the turn ends (see
    ``dex_tasks.integrations.langchain.queue``): stored in the dex session as a queued user
    message, kept out of what the model reads, and added after the model's answer without
    tools; meanwhile the open turn goes on, its pending approval pausing the graph again.
    """

    state_schema = QueueState

    def __init__(
        self,
        client: DexClient | AsyncDexClient,
        *,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        default_effect: EffectClass | str | None = None,
        local_tools: Iterable[str | BaseTool] = (),
    ) -> None:
        super().__init__()
        self._runner = Runner(client, wait_timeout, default_effect, local_tools)

    @hook_config(can_jump_to=["tools"])
    def before_agent(self, state: QueueState, runtime: Any) -> dict[str, Any] | None:
        """Hold a new input given while the thread's turn is open, and go on with that turn."""
        return hold_new_input(self._runner.sync, state)

    @hook_config(can_jump_to=["tools"])
    async def abefore_agent(self, state: QueueState, runtime: Any) -> dict[str, Any] | None:
        """:meth:`before_agent` (the store's reads and writes in a thread)."""
        return await asyncio.to_thread(hold_new_input, self._runner.sync, state)

    @hook_config(can_jump_to=["model"])
    def after_model(self, state: QueueState, runtime: Any) -> dict[str, Any] | None:
        """The turn has ended (an answer without tools): the held inputs follow it."""
        return deliver_held(state)

    @hook_config(can_jump_to=["model"])
    async def aafter_model(self, state: QueueState, runtime: Any) -> dict[str, Any] | None:
        """:meth:`after_model`."""
        return deliver_held(state)

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
            message = unknown_tool_message(call, err)
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
            message = unknown_tool_message(call, err)
        except (Exception, KeyboardInterrupt) as err:
            await run.on_tool_error(err)
            raise
        await run.on_tool_end(message)
        return message
