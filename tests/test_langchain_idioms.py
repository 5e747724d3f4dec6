"""LangChain idioms kept under ``DexMiddleware`` (issue 18, item 5): a local tool outside the
catalog runs in the agent process (``local_tools=``) instead of crashing the run;
``astream_events`` shows a tool start and end for every dex call; one model response's
parallel calls are recorded in one transaction and sent with one publish (``call_tools``).
Real worker, LangChain's own fake chat model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver

import dex_tasks.agent.client as client_module
from dex_tasks import AsyncDexClient, DexClient
from dex_tasks.integrations.langchain import DexMiddleware, dex_tools
from tests.conftest import StartWorker
from tests.langchain_agent_proc import ScriptedChatModel, ai
from workers import ledger


@lc_tool
def add(a: int, b: int) -> int:
    """Add two numbers (a local tool: no worker serves it)."""
    return a + b


def test_local_tools_events_and_one_publish_for_parallel_calls(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_worker()
    published: list[int] = []
    many, single = client_module.publish_many, client_module.publish

    def count_many(app: Any, calls: Any) -> Any:
        published.append(len(calls))
        return many(app, calls)

    def count_one(app: Any, call: Any) -> Any:
        published.append(1)
        return single(app, call)

    monkeypatch.setattr(client_module, "publish_many", count_many)
    monkeypatch.setattr(client_module, "publish", count_one)
    aclient = AsyncDexClient(client=client)
    model = ScriptedChatModel(messages=iter([
        ai(("lookup_order", {"order_id": "1001"}, "c1"), ("lookup_order", {"order_id": "1002"},
                                                         "c2"), ("add", {"a": 2, "b": 3}, "c3")),
        AIMessage("done"),
    ]), disable_streaming=True)  # the fake model's stream drops tool calls
    agent = create_agent(model, tools=[*dex_tools(aclient, ["lookup_order"]), add],
                         middleware=[DexMiddleware(aclient, local_tools=[add])],
                         checkpointer=InMemorySaver())

    async def events() -> list[dict[str, Any]]:
        return [e async for e in agent.astream_events(
            {"messages": [("user", "look up both, and add")]},
            {"configurable": {"thread_id": "th-idioms"}}, version="v2")]

    seen = asyncio.run(events())
    tool_events = [(e["event"], e["name"]) for e in seen
                   if e["event"] in ("on_tool_start", "on_tool_end")]
    assert sorted(tool_events) == sorted([("on_tool_start", "lookup_order")] * 2
                                         + [("on_tool_end", "lookup_order")] * 2
                                         + [("on_tool_start", "add"), ("on_tool_end", "add")])
    ends = [e["data"]["output"] for e in seen
            if e["event"] == "on_tool_end" and e["name"] == "lookup_order"]
    assert all(isinstance(m, ToolMessage) and m.artifact["status"] == "succeeded" for m in ends)
    # The model read all three results: the local tool's too.
    results = {m.tool_call_id: m.content for m in model.received[-1]
               if isinstance(m, ToolMessage)}
    assert results["c3"] == "5"
    assert json.loads(str(results["c2"]))["order_id"] == "1002"
    # The two dex calls were recorded together and sent with one publish; each ran once.
    assert published == [2]
    runs = ledger.executions(ledger_path)
    assert sorted(key.rsplit("/", 1)[1] for key in runs) == ["c1", "c2"]
    assert set(runs.values()) == {1}
