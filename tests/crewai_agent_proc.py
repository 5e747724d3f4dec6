"""A crew process for the kill test of the CrewAI adapter: an offline model charges a card (a
slow single-attempt write, no approval), then reports what the charge tool said.

    python -m tests.crewai_agent_proc SESSION_ID

Uses the ``DEX_*`` settings of the environment; running it again is the restart. The model
is journaled (``DexCrewLLM``), so a restart replays its decision instead of asking it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")

from crewai import Agent, BaseLLM, Crew, Task

from dex_tasks import DexClient
from dex_tasks.integrations.crewai import DexCrewLLM, dex_crew_tools
from tests.helpers import ROOT, load_module

EXAMPLE: Any = load_module(ROOT / "examples" / "crewai_agent.py", "crewai_agent")


class ChargeLLM(BaseLLM):
    """Charges once (``CHARGE_CENTS``, 500 unless set: a model that may decide otherwise when
    asked again), then says what the charge tool returned."""

    def call(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        seen = EXAMPLE.observations(messages)
        if seen:
            return f"Thought: done\nFinal Answer: charge said: {seen[0]}"
        return EXAMPLE.action("charge_card",
                              {"customer_id": "cu_1", "sleep": 3.0,
                               "amount_cents": int(os.environ.get("CHARGE_CENTS", "500"))})

    def supports_function_calling(self) -> bool:
        return False


def crew(client: DexClient, session_id: str) -> Crew:
    agent = Agent(role="billing", goal="Charge the customer.", backstory="A cashier.",
                  llm=DexCrewLLM(client, ChargeLLM(model="scripted"), session_id=session_id),
                  max_iter=4,
                  tools=dex_crew_tools(client, ["charge_card"], session_id=session_id))
    task = Task(description="Charge customer cu_1 500 cents.",
                expected_output="What the charge tool said.", agent=agent)
    return Crew(agents=[agent], tasks=[task])


def main(session_id: str) -> None:
    with DexClient.from_env() as client:
        print(crew(client, session_id).kickoff(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
