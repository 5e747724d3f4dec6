"""A LangChain agent whose tool calls run on dex-tasks workers; offline, with a fake chat model.

The agent looks up order 1001, then refunds it. The refund needs a person's approval, so the
graph pauses and this process exits. Approve (or reject) the refund, then run the script again:
a new process resumes the graph from its SQLite checkpoint, and the refund runs once.

    export DEX_REDIS_URL=redis://127.0.0.1:6379/0 DEX_DATABASE_URL=sqlite:///dex.db
    dex-tasks worker --tools workers.example_tools -c 2 &
    python examples/langchain_agent.py          # looks up the order, then pauses on the refund
    dex-tasks approvals list langchain-demo
    dex-tasks approvals approve langchain-demo INTERRUPT_ID --approver you
    python examples/langchain_agent.py          # a new process resumes: the refund runs once

``--thread`` names the LangGraph thread (the dex session; default ``langchain-demo``) and
``--checkpoints`` the checkpointer's SQLite file (default ``langchain_agent.sqlite``). Needs
``pip install "dex-tasks[langchain]"``.
"""

from __future__ import annotations

import argparse
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolCall
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.sqlite import SqliteSaver

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexMiddleware, dex_tools, resume_command

# What the fake model says, turn by turn; a real model decides this from the conversation.
SCRIPT = [
    AIMessage("", tool_calls=[ToolCall(name="lookup_order", args={"order_id": "1001"},
                                       id="call_1")]),
    AIMessage("", tool_calls=[ToolCall(name="refund_payment",
                                       args={"charge_id": "ch_1001", "amount_cents": 4599},
                                       id="call_2")]),
    AIMessage("Order 1001 is handled; see the refund's result above."),
]


class FakeToolCallingModel(GenericFakeChatModel):
    """LangChain's fake chat model, which replies from a script, accepting tools as a real
    model does."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> FakeToolCallingModel:
        return self


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--thread", default="langchain-demo")
    parser.add_argument("--checkpoints", default="langchain_agent.sqlite")
    args = parser.parse_args()
    config: RunnableConfig = {"configurable": {"thread_id": args.thread}}

    model = FakeToolCallingModel(messages=iter(()))
    with DexClient.from_env() as client, SqliteSaver.from_conn_string(args.checkpoints) as saver:
        # -- the lines dex-tasks adds to an agent ------------------------------------------
        agent = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                             checkpointer=saver)
        # -----------------------------------------------------------------------------------
        state = agent.get_state(config)
        done = sum(isinstance(m, AIMessage) for m in state.values.get("messages", []))
        model.messages = iter(SCRIPT[done:])  # the fake model carries on where the thread is
        if state.interrupts:
            print(f"resuming thread {args.thread} from {args.checkpoints}")
            result = agent.invoke(resume_command(state), config)
        elif done:
            print(f"thread {args.thread} has finished; pass --thread to start another")
            result = state.values
        else:
            result = agent.invoke({"messages": [HumanMessage("Please refund order 1001.")]}, config)

        for message in result["messages"]:
            print(f"  {message.type:>5}: {message.content or message.tool_calls}")
        for pending in result.get("__interrupt__", ()):
            dex = pending.value
            print(f"waiting for approval: {dex['tool']}({dex['arguments']}) "
                  f"interrupt {dex['interrupt_id']}\n"
                  f"  dex-tasks approvals approve {dex['session_id']} {dex['interrupt_id']}\n"
                  f"  then run this script again to resume")


if __name__ == "__main__":
    main()
