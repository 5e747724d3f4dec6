"""A Google ADK agent whose tools run on dex-tasks workers; offline, with a scripted ``BaseLlm``
standing in for Gemini (no API key), and its session in a SQLite file so another process can
take over.

The agent looks up order 1001 (a read: it runs at once) and asks to refund it (a
non-idempotent write: a person must approve). ADK asks for the tool's confirmation; the
process exits. A person decides in dex-tasks; running the script again answers ADK's
confirmation from the dex decision: the refund runs once, or the model reads the rejection.

    dex-tasks worker --tools workers.example_tools    # in the repo root (or: make worker)
    python examples/google_adk_agent.py               # "waiting for a person: ..." (exit 3)
    dex-tasks approvals list adk-demo                 # the refund, with its interrupt id
    dex-tasks approvals approve adk-demo INTERRUPT_ID # or: reject ... -m "why"
    python examples/google_adk_agent.py               # the refund's outcome (exit 0)

Both processes use the worker's ``DEX_*`` settings. Options: ``--sessions PATH`` (the ADK
session file, default ``adk_sessions.db``), ``--session ID``, ``--order ID``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions.sqlite_session_service import SqliteSessionService
from google.genai import types

from dex_tasks import DexClient
from dex_tasks.integrations.google_adk import dex_adk_tools, dex_confirmations

WAITING = 3
APP = "dex-shop"
USER = "customer-1"


class ScriptedLlm(BaseLlm):
    """An offline model that decides from what it has read: lookup, refund, then a report."""

    order_id: str = "1001"

    async def generate_content_async(self, llm_request: LlmRequest, stream: bool = False
                                     ) -> AsyncGenerator[LlmResponse, None]:
        seen = {part.function_response.name: part.function_response.response
                for content in llm_request.contents for part in content.parts or []
                if part.function_response is not None}
        if "lookup_order" not in seen:
            part = _call("lookup_order", {"order_id": self.order_id}, "call_lookup")
        elif "refund_payment" not in seen:
            total = (seen["lookup_order"] or {})["total_cents"]
            part = _call("refund_payment", {"charge_id": f"ch_{self.order_id}",
                                            "amount_cents": total}, "call_refund")
        else:
            part = types.Part(text="refund tool said: " + json.dumps(seen["refund_payment"]))
        yield LlmResponse(content=types.Content(role="model", parts=[part]))


def _call(name: str, args: dict[str, Any], call_id: str) -> types.Part:
    return types.Part(function_call=types.FunctionCall(name=name, args=args, id=call_id))


async def run(client: DexClient, sessions: Path, session_id: str, order_id: str) -> int:
    agent = LlmAgent(name="support", instruction="Help customers with their orders.",
                     model=ScriptedLlm(model="scripted", order_id=order_id),
                     tools=dex_adk_tools(client, ["lookup_order", "refund_payment"]))
    service = SqliteSessionService(str(sessions))
    runner = Runner(agent=agent, app_name=APP, session_service=service)
    session = await service.get_session(app_name=APP, user_id=USER, session_id=session_id)
    if session is None:  # a new conversation
        await service.create_session(app_name=APP, user_id=USER, session_id=session_id)
        message: types.Content | None = types.Content(
            role="user", parts=[types.Part(text=f"Please refund order {order_id}.")])
    else:  # a person was asked: answer ADK's confirmation from the dex decision
        message = await dex_confirmations(client, session)
        if message is None:
            return waiting(client, session_id)
    final = ""
    async for event in runner.run_async(user_id=USER, session_id=session_id,
                                        new_message=message):
        for part in (event.content.parts or []) if event.content else []:
            if part.text and event.author == agent.name:
                final = part.text
    if final:
        print(final)
        return 0
    return waiting(client, session_id)


def waiting(client: DexClient, session_id: str) -> int:
    for pending in client.get_agent_snapshot(session_id).pending_interrupts:
        print(f"waiting for a person: {pending.tool} {json.dumps(pending.arguments)} "
              f"(interrupt {pending.interrupt_id}); decide with: dex-tasks approvals approve "
              f"{session_id} {pending.interrupt_id}")
    return WAITING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=Path, default=Path("adk_sessions.db"))
    parser.add_argument("--session", default="adk-demo")
    parser.add_argument("--order", default="1001")
    args = parser.parse_args(argv)
    with DexClient.from_env() as client:
        return asyncio.run(run(client, args.sessions, args.session, args.order))


if __name__ == "__main__":
    sys.exit(main())
