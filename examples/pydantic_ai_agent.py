"""A Pydantic AI support agent whose tool calls run through dex-tasks, offline.

The model is Pydantic AI's ``FunctionModel`` playing a script: look order 1001 up, refund its
charge, then report what the refund tool returned. It reuses the tool-call id ``call-1`` in
every turn, as fake models do; dex-tasks keys the calls by the response that holds them, so they
never collide. The tools come from the catalog the worker published: this file imports none.

Run it against a worker (``workers.example_tools`` has ``lookup_order``, a read, and
``refund_payment``, a non-idempotent write that waits for a person)::

    export DEX_REDIS_URL=redis://127.0.0.1:6379/0 DEX_DATABASE_URL=sqlite:///dex.db
    export DEX_SECRET_KEY=change-me
    dex-tasks worker --tools workers.example_tools -c 2 &
    python examples/pydantic_ai_agent.py          # looks order 1001 up, asks to refund: pauses
    dex-tasks approvals list                      # the refund waits for a person
    dex-tasks approvals approve SESSION INTERRUPT # or: dex-tasks approvals reject ... -m "why"
    python examples/pydantic_ai_agent.py          # a new process resumes: the refund runs once

A paused run's messages are kept in ``--history`` (default ``pydantic_ai_agent.history.json``);
the file is removed when the run ends, so the next start is a new conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from pydantic_ai import Agent, DeferredToolRequests, ModelMessagesTypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dex_tasks import DexClient
from dex_tasks.integrations.pydantic_ai import ApprovalPendingError, DexCapability


def support_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The scripted model: one tool call per turn, then a reply saying what the tools returned."""
    returned = {part.tool_name: part for message in messages for part in message.parts
                if isinstance(part, ToolReturnPart)}
    lookup = returned.get("lookup_order")
    if lookup is None:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "1001"},
                                                 tool_call_id="call-1")])
    if lookup.outcome != "success":
        return ModelResponse(parts=[TextPart(f"lookup_order {lookup.outcome}: "
                                             f"{lookup.model_response_str()}")])
    refund = returned.get("refund_payment")
    if refund is None:
        order = json.loads(lookup.model_response_str())  # the text the model reads
        return ModelResponse(parts=[ToolCallPart(
            "refund_payment",
            {"charge_id": f"ch_{order['order_id']}", "amount_cents": order["total_cents"]},
            tool_call_id="call-1",
        )])
    return ModelResponse(parts=[TextPart(f"refund_payment {refund.outcome}: "
                                         f"{refund.model_response_str()}")])


async def main(history_path: Path) -> None:
    client = DexClient.from_env()
    dex = DexCapability(client)
    agent = Agent(FunctionModel(support_model), capabilities=[dex],
                  output_type=[str, DeferredToolRequests])
    try:
        if history_path.exists():
            history = ModelMessagesTypeAdapter.validate_json(history_path.read_bytes())
            try:
                results = await dex.deferred_results(history)
            except ApprovalPendingError as err:
                print(f"still waiting: {err}")
                return
            result = await agent.run(message_history=history, deferred_tool_results=results)
        else:
            result = await agent.run("Please refund order 1001.")
        if isinstance(result.output, DeferredToolRequests):
            history_path.write_bytes(ModelMessagesTypeAdapter.dump_json(result.all_messages()))
            for call in result.output.approvals:
                meta = result.output.metadata[call.tool_call_id]
                print(f"paused: {call.tool_name}({json.dumps(call.args_as_dict())}) waits for "
                      f"approval: dex-tasks approvals approve {meta['dex_session_id']} "
                      f"{meta['dex_interrupt_id']}")
            for call in result.output.calls:
                print(f"deferred: {call.tool_name} is still running; run again to wait for it")
            return
        history_path.unlink(missing_ok=True)
        print(f"answer: {result.output}")
    finally:
        client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=Path, default=Path("pydantic_ai_agent.history.json"),
                        help="where a paused run's messages are kept")
    asyncio.run(main(parser.parse_args().history))
