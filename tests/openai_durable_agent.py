"""An OpenAI Agents SDK agent process for the durable-turn tests (``test_durable_turns.py``).

    python -m tests.openai_durable_agent SESSION MODEL_LOG [KILL_AT]

One turn: the model charges a card (``charge_card``, a non-idempotent write that sleeps), then
asks for a refund (``refund_payment``, which a person approves), then answers. The model is
the SDK's own ``ScriptedModel``; like a real model it mints a new call id each time it is
asked, so a model asked twice for one decision would charge twice. It appends a line to
``MODEL_LOG`` each time it answers a decision (0, 1, 2).

The process runs the README's restart rule: the same ``Runner.run`` with
``dex_context(session, client=client)`` and ``dex_run_config(client)``, then the
``apply_dex_decisions`` loop, which here waits for the person (polling) instead of exiting.

``KILL_AT`` makes the process SIGKILL itself at one point (once: a marker file next to
``MODEL_LOG`` keeps the next process from doing it again): ``model0`` / ``model2`` while the
model is asked decision 0 / 2 (before it answered; decision 2 comes after the refund ended),
``dispatch`` after a step was journaled and before its calls were sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.items import TResponseOutputItem
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

import dex_tasks.agent.client as client_module
from dex_tasks import DexClient
from dex_tasks.integrations.openai_agents import (
    apply_dex_decisions,
    dex_context,
    dex_function_tools,
    dex_run_config,
)

INPUT = "Charge customer c-1 5 dollars, then refund 1 dollar of it."


def kill_once(log: Path, point: str, kill_at: str) -> None:
    marker = log.with_name(f"killed-{point}")
    if point == kill_at and not marker.exists():
        marker.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)


def decision(call: ModelCall) -> int:
    """Which decision the model is asked: by the tools whose results it has read."""
    names = {item["call_id"]: item["name"] for item in call.input
             if isinstance(item, dict) and item.get("type") == "function_call"}
    done = {names.get(item["call_id"]) for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}
    return 0 if "charge_card" not in done else 1 if "refund_payment" not in done else 2


def model(log: Path, kill_at: str, sleep: float) -> ScriptedModel:
    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        n = decision(call)
        kill_once(log, f"model{n}", kill_at)
        with log.open("a") as f:
            f.write(json.dumps({"decision": n, "pid": os.getpid()}) + "\n")
        fresh = f"call_{uuid.uuid4().hex[:12]}"  # a real model mints new ids
        if n == 0:
            return [function_call("charge_card", {"customer_id": "c-1", "amount_cents": 500,
                                                  "sleep": sleep}, call_id=fresh)]
        if n == 1:
            return [function_call("refund_payment", {"charge_id": "ch_c-1",
                                                     "amount_cents": 100}, call_id=fresh)]
        return [assistant_message("Charged and refunded.")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(3)])


async def main(session: str, log: Path, kill_at: str, sleep: float) -> None:
    set_tracing_disabled(True)
    publish_many = client_module.publish_many

    def publishing(app: Any, calls: Any) -> Any:
        kill_once(log, "dispatch", kill_at)
        return publish_many(app, calls)

    single = client_module.publish

    def publishing_one(app: Any, call: Any) -> Any:
        kill_once(log, "dispatch", kill_at)
        return single(app, call)

    # The journal and the calls commit first, then the calls are sent: die in between.
    client_module.publish_many = publishing
    client_module.publish = publishing_one
    with DexClient.from_env() as client:
        agent = Agent(name="billing", instructions="Bill, then refund.",
                      tools=dex_function_tools(client, ["charge_card", "refund_payment"]),
                      model=model(log, kill_at, sleep))
        result = await Runner.run(agent, INPUT, context=dex_context(session, client=client),
                                  run_config=dex_run_config(client))
        while result.interruptions:
            state = result.to_state()
            while await apply_dex_decisions(state, client):
                await asyncio.sleep(0.1)  # a person decides; this process waits (or is killed)
            result = await Runner.run(agent, state, run_config=dex_run_config(client))
        print(json.dumps({"final": result.final_output}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "",
                     float(os.environ.get("DEX_TEST_SLEEP", "0"))))
