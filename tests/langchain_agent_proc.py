"""An agent process for the LangChain adapter's tests, and the fake model they share.

    python -m tests.langchain_agent_proc CHECKPOINTS THREAD SCRIPT

runs a ``create_agent`` agent with :class:`DexMiddleware` on thread ``THREAD``, checkpointed in
the SQLite file ``CHECKPOINTS``, until it ends or pauses (a test may kill it before that).
``SCRIPT`` is a JSON list of the fake model's replies (``{"content": ..., "tool_calls": [...]}``).
The DEX_* environment configures the client.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolCall
from langchain_core.outputs import ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic import Field

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexMiddleware, dex_tools


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's ``GenericFakeChatModel``, which also accepts tools and records what it was
    sent (``received``: the messages of each call; ``offered``: the tools, as OpenAI specs)."""

    received: list[list[BaseMessage]] = Field(default_factory=list)
    offered: list[dict[str, Any]] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:
        self.offered = [convert_to_openai_tool(t) for t in tools]
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        self.received.append(list(messages))
        return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)


def ai(*calls: tuple[str, dict[str, Any], str], content: str = "") -> AIMessage:
    """An AI message that calls ``(tool, arguments, tool_call_id)`` for each of ``calls``."""
    return AIMessage(content, tool_calls=[ToolCall(name=n, args=a, id=i) for n, a, i in calls])


def main(checkpoints: str, thread: str, script: str) -> None:
    replies = [AIMessage(r.get("content", ""), tool_calls=r.get("tool_calls", []))
               for r in json.loads(script)]
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    model = ScriptedChatModel(messages=iter(replies))
    with DexClient.from_env() as client, SqliteSaver.from_conn_string(checkpoints) as saver:
        agent = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                             checkpointer=saver)
        # durability="sync": each step's checkpoint is on disk before the next step starts, so
        # a process killed while a tool runs always leaves the AI message that called it.
        result = agent.invoke({"messages": [("user", "go")]}, config, durability="sync")
    print(json.dumps([m.model_dump(mode="json") for m in result["messages"]]), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
