"""A CrewAI crew whose tools run on dex-tasks workers; offline, with a scripted ``BaseLLM``
standing in for a real model (no API key).

The agent looks up order 1001 (a read: it runs at once) and asks to refund it (a
non-idempotent write: a person must approve). The tool tells the agent the refund awaits a
person; the crew ends its task and the process exits. A person decides in dex-tasks; running
the script again runs the same crew with the same session: the model's journaled decisions
are replayed (the lookup gives its recorded result), the refund runs once, or the agent reads
the rejection.

    dex-tasks worker --tools workers.example_tools    # in the repo root (or: make worker)
    python examples/crewai_agent.py                   # "waiting for a person: ..." (exit 3)
    dex-tasks approvals list crew-demo                # the refund, with its interrupt id
    dex-tasks approvals approve crew-demo INTERRUPT_ID  # or: reject ... -m "why"
    python examples/crewai_agent.py                   # the refund's outcome (exit 0)

Both processes use the worker's ``DEX_*`` settings. Options: ``--session ID``, ``--order ID``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")  # offline: no telemetry
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import Agent, BaseLLM, Crew, Task

from dex_tasks import DexClient
from dex_tasks.integrations.crewai import DexCrewLLM, dex_crew_tools

WAITING = 3
OBSERVATION = re.compile(r"^Observation: (.*)$", re.M)


class ScriptedLLM(BaseLLM):
    """An offline model in CrewAI's ReAct format that decides from the observations it has
    read: look the order up, refund it, then report what the refund tool said."""

    def __init__(self, order_id: str = "1001") -> None:
        super().__init__(model="scripted")
        self.order_id = order_id
        self.asked = 0

    def call(self, messages: Any, tools: Any = None, callbacks: Any = None,
             available_functions: Any = None, from_task: Any = None, from_agent: Any = None,
             response_model: Any = None) -> str:
        self.asked += 1
        seen = observations(messages)
        if not seen:
            return action("lookup_order", {"order_id": self.order_id})
        if len(seen) == 1:
            total = json.loads(seen[0])["total_cents"]
            return action("refund_payment", {"charge_id": f"ch_{self.order_id}",
                                             "amount_cents": total})
        return f"Thought: I now know the final answer\nFinal Answer: refund tool said: {seen[1]}"

    def supports_function_calling(self) -> bool:
        return False  # CrewAI's ReAct loop: Action / Action Input / Observation


def observations(messages: Any) -> list[str]:
    """The tool observations CrewAI added to the conversation, in order."""
    texts = [messages] if isinstance(messages, str) else [
        str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
    return [found for text in texts for found in OBSERVATION.findall(text)]


def action(tool: str, arguments: dict[str, Any]) -> str:
    return (f"Thought: I should use {tool}\nAction: {tool}\n"
            f"Action Input: {json.dumps(arguments)}")


def build_crew(client: DexClient, session_id: str, order_id: str) -> Crew:
    tools = dex_crew_tools(client, ["lookup_order", "refund_payment"], session_id=session_id)
    agent = Agent(role="support", goal="Help customers with their orders.",
                  backstory="You answer from the shop's tools.", tools=tools,
                  llm=DexCrewLLM(client, ScriptedLLM(order_id), session_id=session_id),
                  max_iter=6)
    task = Task(description=f"Refund order {order_id}.", expected_output="The refund's outcome.",
                agent=agent)
    return Crew(agents=[agent], tasks=[task])


def run(client: DexClient, session_id: str, order_id: str) -> int:
    return run_crew(client, build_crew(client, session_id, order_id), session_id)


def run_crew(client: DexClient, crew: Crew, session_id: str) -> int:
    output = str(crew.kickoff())
    pending = client.get_agent_snapshot(session_id).pending_interrupts
    for interrupt in pending:
        print(f"waiting for a person: {interrupt.tool} {json.dumps(interrupt.arguments)} "
              f"(interrupt {interrupt.interrupt_id}); decide with: dex-tasks approvals approve "
              f"{session_id} {interrupt.interrupt_id}")
    if pending:
        return WAITING
    print(output)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--session", default="crew-demo")
    parser.add_argument("--order", default="1001")
    args = parser.parse_args(argv)
    with DexClient.from_env() as client:
        return run(client, args.session, args.order)


if __name__ == "__main__":
    sys.exit(main())
