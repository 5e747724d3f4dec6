"""An OpenAI Agents SDK agent that reaches dex-tasks through its own MCP client
(``mcp_servers=``): no dex-tasks adapter, only ``dex-tasks mcp`` over stdio. Offline: the SDK's
``ScriptedModel`` stands in for the model (no API key, tracing off).

The agent looks up order 1001 (a read: it runs at once) and asks to refund it (a
non-idempotent write: a person must approve). ``dex-tasks mcp`` waits for the decision a short
while, then answers that the call awaits approval; the model says so and the process exits. A
person decides; running the script again asks again with the same ids (the run context's turn
and the model's call id, sent as the request's ``_meta``), so the refund runs once, or the
model reads the rejection.

    dex-tasks worker --tools workers.example_tools     # in the repo root (or: make worker)
    python examples/mcp_server_agent.py                # "waiting for a person: ..." (exit 3)
    dex-tasks approvals approve mcp-demo INTERRUPT_ID  # or: reject ... -m "why"
    python examples/mcp_server_agent.py                # the refund's outcome (exit 0)

Both processes (and the ``dex-tasks mcp`` each starts) use the worker's ``DEX_*`` settings.
Options: ``--session ID``, ``--order ID``, ``--approval-timeout SECONDS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.items import TResponseOutputItem
from agents.mcp import MCPServerStdio, MCPToolMetaContext
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

WAITING = 3
AWAITING_APPROVAL = "DEX_AWAITING_APPROVAL"  # how dex-tasks mcp says a person has yet to decide


def dex_ids(context: MCPToolMetaContext) -> dict[str, Any]:
    """The request's ``_meta``: the session and turn from the run context, the model's call
    id (the SDK hands the resolver the tool's context, which has it)."""
    run = context.run_context
    return {"dex/session_id": run.context["session_id"], "dex/turn_id": run.context["turn_id"],
            "dex/tool_call_id": getattr(run, "tool_call_id", None)}


def tool_outputs(call: ModelCall) -> dict[str, str]:
    """The tool results the model has been given so far (their text), by call id."""
    return {item["call_id"]: _text(item["output"]) for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def _text(output: Any) -> str:
    # An MCP tool's result reaches the model as a list of content parts.
    if isinstance(output, list):
        return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
    return str(output)


def scripted_model(order_id: str) -> ScriptedModel:
    """A fake model that decides from what it has read: lookup, refund, then a report."""

    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        seen = tool_outputs(call)
        if "call_lookup" not in seen:
            return [function_call("lookup_order", {"order_id": order_id}, call_id="call_lookup")]
        if "call_refund" not in seen:
            order: dict[str, Any] = json.loads(seen["call_lookup"])
            return [function_call("refund_payment", {"charge_id": f"ch_{order_id}",
                                                     "amount_cents": order["total_cents"]},
                                  call_id="call_refund")]
        return [assistant_message(f"refund tool said: {seen['call_refund']}")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(3)])


def dex_mcp_command() -> list[str]:
    """``dex-tasks`` of this environment (the console script beside this Python)."""
    script = shutil.which("dex-tasks", path=os.path.dirname(sys.executable)) or "dex-tasks"
    return [script]


def dex_mcp_server(approval_timeout: float) -> MCPServerStdio:
    """``dex-tasks mcp`` over stdio, as the SDK's MCP server, with the worker's settings."""
    command = dex_mcp_command()
    return MCPServerStdio(
        params={"command": command[0],
                "args": [*command[1:], "mcp", "--approval-timeout", str(approval_timeout)],
                "env": dict(os.environ)},
        tool_meta_resolver=dex_ids, client_session_timeout_seconds=60, cache_tools_list=True,
    )


async def run(server: MCPServerStdio, session_id: str, order_id: str) -> int:
    """One run of the agent on the session's turn ``turn-1``; exit status 0 or WAITING."""
    agent = Agent(name="support", instructions="Help customers with their orders.",
                  model=scripted_model(order_id), mcp_servers=[server])
    result = await Runner.run(agent, f"Please refund order {order_id}.",
                              context={"session_id": session_id, "turn_id": "turn-1"})
    print(result.final_output)
    return WAITING if AWAITING_APPROVAL in str(result.final_output) else 0


async def run_once(session_id: str, order_id: str, approval_timeout: float) -> int:
    async with dex_mcp_server(approval_timeout) as server:
        return await run(server, session_id, order_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--session", default="mcp-demo")
    parser.add_argument("--order", default="1001")
    parser.add_argument("--approval-timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    set_tracing_disabled(True)  # offline: nothing to export traces to
    return asyncio.run(run_once(args.session, args.order, args.approval_timeout))


if __name__ == "__main__":
    sys.exit(main())
