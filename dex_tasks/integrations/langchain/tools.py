"""``dex_tools``: LangChain tools built from the catalog the workers published."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.messages import ToolCall, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.prebuilt import ToolRuntime

from dex_tasks import (
    AsyncDexClient,
    DexClient,
    EffectClass,
    InvalidArgumentError,
    InvalidCallError,
    ToolSpec,
    UnknownToolError,
)
from dex_tasks.integrations.langchain.calls import DEFAULT_WAIT_TIMEOUT, Runner


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
    runner = Runner(client, wait_timeout, default_effect)
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


def _structured_tool(spec: ToolSpec, runner: Runner) -> StructuredTool:
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
