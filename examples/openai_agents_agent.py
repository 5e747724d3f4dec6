"""An OpenAI Agents SDK agent whose tools run on dex-tasks workers; offline, with the SDK's own
``ScriptedModel`` standing in for the model (no API key, tracing off).

The agent looks up order 1001 (a read: it runs at once) and asks to refund it (a
non-idempotent write: a person must approve). The run pauses, its state goes to a file and the
process exits; a person decides; running the script again resumes the run in a new process.

    dex-tasks worker --tools workers.example_tools   # in the repo root (or: make worker)
    python examples/openai_agents_agent.py           # pauses: "waiting for a person: ..."
    dex-tasks approvals list                         # the refund, with its interrupt id
    dex-tasks approvals approve demo-session INTERRUPT_ID    # or: reject ... -m "why"
    python examples/openai_agents_agent.py           # resumes: the refund runs once, or the
                                                     # model reads the rejection

Both processes use the ``DEX_*`` settings of the worker (same Redis and store). Options:
``--state PATH`` (default ``openai_agents_run.json``), ``--session ID``, ``--order ID``.
Exit status 0 when the run finished, 3 while it waits for a person.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from agents import Agent, Runner, RunState, set_tracing_disabled
from agents.items import TResponseOutputItem
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from dex_tasks import DexClient
from dex_tasks.integrations.openai_agents import apply_dex_decisions, dex_function_tools

WAITING = 3


def tool_outputs(call: ModelCall) -> dict[str, str]:
    """The tool results the model has been given so far, by call id."""
    return {item["call_id"]: item["output"] for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def scripted_model(order_id: str) -> ScriptedModel:
    """A fake model that decides from what it has read, so a new process can take over."""

    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        seen = tool_outputs(call)
        if "call_lookup" not in seen:
            return [function_call("lookup_order", {"order_id": order_id}, call_id="call_lookup")]
        if "call_refund" not in seen:
            order: dict[str, Any] = json.loads(seen["call_lookup"])
            return [function_call("refund_payment", {"charge_id": f"ch_{order_id}",
                                                     "amount_cents": order["total_cents"]},
                                  call_id="call_refund")]
        return [assistant_message(f"Order {order_id}: refund tool said {seen['call_refund']}")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(4)])


async def run(client: DexClient, state_path: Path, session_id: str, order_id: str) -> int:
    agent = Agent(name="support", instructions="Help customers with their orders.",
                  model=scripted_model(order_id),
                  tools=dex_function_tools(client, ["lookup_order", "refund_payment"]))
    if state_path.exists():  # a person was asked: take over where the last process stopped
        st = await RunState.from_string(agent, state_path.read_text())
    else:
        result = await Runner.run(agent, f"Please refund order {order_id}.",
                                  context={"session_id": session_id, "turn_id": "turn-1"})
        st = result.to_state()
    while st.get_interruptions():
        if await apply_dex_decisions(st, client):
            return wait_for_people(client, st, state_path, session_id)
        result = await Runner.run(agent, st)
        st = result.to_state()
    print(result.final_output)
    state_path.unlink(missing_ok=True)
    return 0


def wait_for_people(client: DexClient, st: RunState[Any, Any], state_path: Path,
                    session_id: str) -> int:
    """Save the paused run and say what a person must decide."""
    state_path.write_text(st.to_string())
    for pending in client.get_agent_snapshot(session_id).pending_interrupts:
        print(f"waiting for a person: {pending.tool} {json.dumps(pending.arguments)} "
              f"(interrupt {pending.interrupt_id}); decide with: dex-tasks approvals approve "
              f"{session_id} {pending.interrupt_id}")
    return WAITING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--state", type=Path, default=Path("openai_agents_run.json"))
    parser.add_argument("--session", default="demo-session")
    parser.add_argument("--order", default="1001")
    args = parser.parse_args(argv)
    set_tracing_disabled(True)  # offline: nothing to export traces to
    with DexClient.from_env() as client:
        return asyncio.run(run(client, args.state, args.session, args.order))


if __name__ == "__main__":
    sys.exit(main())
