"""A LangGraph agent process for the durable-turn tests (``test_durable_turns_langgraph.py``).

    python -m tests.langgraph_durable_agent THREAD MODEL_LOG [KILL_AT]

The same turn as ``tests/openai_durable_agent.py``: a charge (a non-idempotent write that
sleeps), a refund a person approves, an answer; a fake chat model that mints new tool-call ids
each time it is asked and logs each answer. ``create_agent`` with ``DexMiddleware`` and
``DexCheckpointer`` (no second database), ``durability="sync"``. Restarting is LangGraph's own
form on the same thread: the input when the thread is new, ``invoke(None)`` for an unfinished
step, ``resume_command`` once the person decided. ``KILL_AT``: ``model0``/``model2`` (while
the model is asked that decision), ``dispatch`` (the calls recorded, not yet sent).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig

import dex_tasks.agent.client as client_module
from dex_tasks import DexClient
from dex_tasks.integrations.langchain import (
    DexCheckpointer,
    DexMiddleware,
    dex_tools,
    resume_command,
)
from tests.openai_durable_agent import INPUT, kill_once


class DecidingModel(BaseChatModel):
    """Decides from the tool results it has read; logs each answer; new ids every time."""

    log: str
    kill_at: str = ""
    sleep: float = 0.0

    @property
    def _llm_type(self) -> str:
        return "deciding-fake"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> DecidingModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        done = {m.name for m in messages if isinstance(m, ToolMessage)}
        n = 0 if "charge_card" not in done else 1 if "refund_payment" not in done else 2
        log = Path(self.log)
        kill_once(log, f"model{n}", self.kill_at)
        with log.open("a") as f:
            f.write(json.dumps({"decision": n, "pid": os.getpid()}) + "\n")
        fresh = f"call_{uuid.uuid4().hex[:12]}"
        if n == 0:
            message = AIMessage("", tool_calls=[ToolCall(
                name="charge_card", args={"customer_id": "c-1", "amount_cents": 500,
                                          "sleep": self.sleep}, id=fresh)])
        elif n == 1:
            message = AIMessage("", tool_calls=[ToolCall(
                name="refund_payment", args={"charge_id": "ch_c-1", "amount_cents": 100},
                id=fresh)])
        else:
            message = AIMessage("Charged and refunded.")
        return ChatResult(generations=[ChatGeneration(message=message)])


def main(thread: str, log: Path, kill_at: str, sleep: float) -> None:
    many, single = client_module.publish_many, client_module.publish

    def publishing(app: Any, calls: Any) -> Any:
        kill_once(log, "dispatch", kill_at)
        return many(app, calls)

    def publishing_one(app: Any, call: Any) -> Any:
        kill_once(log, "dispatch", kill_at)
        return single(app, call)

    client_module.publish_many, client_module.publish = publishing, publishing_one
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    with DexClient.from_env() as client:
        agent = create_agent(DecidingModel(log=str(log), kill_at=kill_at, sleep=sleep),
                             tools=dex_tools(client, ["charge_card", "refund_payment"]),
                             middleware=[DexMiddleware(client)],
                             checkpointer=DexCheckpointer(client))
        state = agent.get_state(config)
        if not state.values:
            agent.invoke({"messages": [("user", INPUT)]}, config, durability="sync")
        while (state := agent.get_state(config)).next:
            if state.interrupts:
                # A person decides; this process waits (or is killed meanwhile).
                while client.get_agent_snapshot(thread).pending_interrupts:
                    time.sleep(0.1)
                agent.invoke(resume_command(state), config, durability="sync")
            else:
                agent.invoke(None, config, durability="sync")
        final = agent.get_state(config).values["messages"][-1]
    print(json.dumps({"final": final.content}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "",
         float(os.environ.get("DEX_TEST_SLEEP", "0")))
