"""Edits on approval through the framework adapters (issue 21, item 2 and the edit note).

Offline, each framework's own test model plays the model (Pydantic AI's ``FunctionModel``, the
OpenAI Agents SDK's ``ScriptedModel``), against real Redis and a real ``dex-tasks worker``
serving ``issue_refund`` (a rule: refunds over 10,000 cents wait for a person). What each shows:

* only the calls the rule sends to a person pause the run; the others run at once;
* an edit made the framework's way (Pydantic AI's ``ToolApproved(override_args=...)``) or the
  dex way (``resolve_interrupt(..., arguments=...)``, OpenAI's SDK having no edit of its own)
  runs the tool once, with the edited arguments, under the call's key;
* the model reads that the arguments were edited and how, and so does the transcript's tool
  message (``get_agent_snapshot().messages``), which is what every adapter renders.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, FunctionTool, Runner, RunResult, RunState, set_tracing_disabled
from agents.items import TResponseOutputItem
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolApproved
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dex_tasks import CallStatus, DexClient, InvalidEditError, MessageRole, tool_message_text
from dex_tasks.integrations.openai_agents import apply_dex_decisions, dex_function_tools
from dex_tasks.integrations.pydantic_ai import DexCapability
from tests.conftest import StartWorker
from workers import ledger

set_tracing_disabled(True)

NOTE = "the arguments were edited before approval: amount_cents 50000 -> 9000"
SMALL = {"charge_id": "ch_small", "amount_cents": 500}
LARGE = {"charge_id": "ch_large", "amount_cents": 50_000}
EDITED = {"charge_id": "ch_large", "amount_cents": 9_000}


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2, tools="workers.example_tools")


def _tool_message(client: DexClient, session: str, key: str) -> Any:
    (message,) = [m for m in client.get_agent_snapshot(session).messages
                  if m.role is MessageRole.TOOL and m.key == key]
    return message


def test_pydantic_ai_override_args_edit_the_dex_call_and_the_model_is_told(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    received: list[ModelMessage] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        received.append(messages[-1])
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("issue_refund", SMALL, tool_call_id="c-s"),
                                        ToolCallPart("issue_refund", LARGE, tool_call_id="c-l")])
        return ModelResponse(parts=[TextPart("done")])

    dex = DexCapability(client, session_id="pyd-edit")

    def agent() -> PydanticAgent[None, Any]:
        return PydanticAgent(FunctionModel(model), capabilities=[dex],
                             output_type=[str, DeferredToolRequests])

    # Given one response with a small and a large refund: only the large one is deferred
    paused = asyncio.run(agent().run("Refund both"))
    requests = paused.output
    assert isinstance(requests, DeferredToolRequests)
    assert [c.tool_call_id for c in requests.approvals] == ["c-l"]
    key = requests.metadata["c-l"]["dex_key"]

    # An override the tool's schema refuses is refused naming the field; nothing changes
    bad = DeferredToolResults(approvals={"c-l": ToolApproved(
        override_args={"charge_id": "ch_large", "amount_cents": "lots"})})
    with pytest.raises(InvalidEditError, match="amount_cents"):
        asyncio.run(dex.apply_decisions(requests, bad, approver="alice"))
    assert client.get_tool_call(key).status is CallStatus.AWAITING_APPROVAL

    # When the person's decision comes the Pydantic AI way, with override_args
    native = DeferredToolResults(approvals={"c-l": ToolApproved(override_args=EDITED)})
    results = asyncio.run(dex.apply_decisions(requests, native, approver="alice"))
    # Then dex-tasks recorded it as an edit, and answers the run natively with the edit
    answer = results.approvals["c-l"]
    assert isinstance(answer, ToolApproved) and answer.override_args == EDITED
    resumed = asyncio.run(agent().run(message_history=paused.all_messages(),
                                      deferred_tool_results=results))
    assert resumed.output == "done"

    # The tool ran once with the edited arguments under the same key; the small one once too
    record = client.get_tool_call(key)
    assert (record.status, record.arguments, record.original_arguments) == (
        CallStatus.SUCCEEDED, EDITED, LARGE)
    assert ledger.executions(ledger_path)[key] == 1 and len(ledger.read(ledger_path)) == 2
    # The model read the result, and a note next to it that says what was edited
    last = received[-1]
    assert isinstance(last, ModelRequest)
    returns = {p.tool_call_id: p.content for p in last.parts if isinstance(p, ToolReturnPart)}
    assert returns["c-l"] == {"charge_id": "ch_large", "refunded_cents": 9_000}
    notes = [p.content for p in last.parts if isinstance(p, UserPromptPart)]
    assert notes == [f"issue_refund call c-l: {NOTE}"]
    # And so does the transcript, for every reader of the session
    message = _tool_message(client, "pyd-edit", key)
    assert message.text == NOTE
    assert tool_message_text(message).startswith(f"({NOTE})\n")
    assert json.loads(message.tool_arguments) == EDITED

    # Without a durable turn (keys from the history), an edit made the dex way is answered
    # with override_args too; the run asks with the edited arguments, which dex-tasks takes as
    # the same call: it runs once
    plain = DexCapability(client)
    agent_plain = PydanticAgent(FunctionModel(model), capabilities=[plain],
                                output_type=[str, DeferredToolRequests])
    stopped = asyncio.run(agent_plain.run("Refund both", conversation_id="pyd-plain"))
    assert isinstance(stopped.output, DeferredToolRequests)
    meta = stopped.output.metadata["c-l"]
    assert client.resolve_interrupt("pyd-plain", meta["dex_interrupt_id"], True,
                                    approver="bob", arguments=EDITED)
    answers = asyncio.run(plain.deferred_results(stopped.all_messages()))
    approved = answers.approvals["c-l"]
    assert isinstance(approved, ToolApproved) and approved.override_args == EDITED
    for _ in range(2):  # resumed twice: still one run of the tool
        again = asyncio.run(agent_plain.run(message_history=stopped.all_messages(),
                                            deferred_tool_results=answers))
        assert again.output == "done"
    assert ledger.executions(ledger_path)[meta["dex_key"]] == 1
    assert client.get_tool_call(meta["dex_key"]).result == {"charge_id": "ch_large",
                                                            "refunded_cents": 9_000}


def _outputs(call: ModelCall) -> dict[str, str]:
    return {item["call_id"]: item["output"] for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def test_openai_agents_pause_only_what_the_rule_holds_and_read_the_dex_edit(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        seen = _outputs(call)
        if not seen:
            return [function_call("issue_refund", SMALL, call_id="c-s"),
                    function_call("issue_refund", LARGE, call_id="c-l")]
        return [assistant_message("done")]

    model = ScriptedModel([ModelStep.respond(respond) for _ in range(4)])
    tools = dex_function_tools(client, ["issue_refund"])
    (refund,) = tools
    assert isinstance(refund, FunctionTool) and callable(refund.needs_approval)
    agent = Agent(name="billing", model=model, tools=tools)
    context = {"session_id": "oai-edit", "turn_id": "t1"}

    # Given one response with a small and a large refund: the rule pauses the large one only
    first = asyncio.run(Runner.run(agent, "Refund both", context=context))
    assert [item.call_id for item in first.interruptions] == ["c-l"]
    paused = first.to_state()
    assert len(asyncio.run(apply_dex_decisions(paused, client))) == 1
    (pending,) = client.get_agent_snapshot("oai-edit").pending_interrupts
    assert pending.arguments == LARGE

    # When a person edits in dex-tasks (the SDK has no edit decision of its own)
    assert client.resolve_interrupt("oai-edit", pending.interrupt_id, True, approver="alice",
                                    arguments=EDITED)

    async def resume() -> RunResult:
        restored = await RunState.from_string(agent, paused.to_string())
        assert await apply_dex_decisions(restored, client) == []
        return await Runner.run(agent, restored)

    assert asyncio.run(resume()).final_output == "done"
    # Then the tool ran once with the edited arguments; the small refund ran at once, once
    executions = ledger.executions(ledger_path)
    assert executions == {"oai-edit/t1/c-s": 1, "oai-edit/t1/c-l": 1}
    assert client.get_tool_call("oai-edit/t1/c-l").arguments == EDITED
    # And the model read the note, then the result
    told = _outputs(model.calls[-1])
    assert told["c-l"] == f'({NOTE})\n{{"charge_id": "ch_large", "refunded_cents": 9000}}'
    assert json.loads(told["c-s"]) == {"charge_id": "ch_small", "refunded_cents": 500}
    # And the transcript's tool message carries the same note
    assert _tool_message(client, "oai-edit", "oai-edit/t1/c-l").text == NOTE
    assert _tool_message(client, "oai-edit", "oai-edit/t1/c-s").text is None


def test_every_adapter_renders_the_edit_note_for_the_model() -> None:
    from datetime import UTC, datetime

    from dex_tasks import ToolCallRecord
    from dex_tasks.integrations.google_adk import model_result
    from dex_tasks.integrations.langchain import _tool_message
    from dex_tasks.integrations.mcp_server import _result

    record = ToolCallRecord(
        key="s/t/c", session_id="s", turn_id="t", tool_call_id="c", tool="issue_refund",
        arguments=EDITED, original_arguments=LARGE, effect="non_idempotent_write",
        requires_approval=True, status="succeeded",
        result={"charge_id": "ch_large", "refunded_cents": 9_000}, created_at=datetime.now(UTC))
    assert tool_message_text(record) == (
        f'({NOTE})\n{{"charge_id": "ch_large", "refunded_cents": 9000}}')
    langchain = _tool_message(record, {"id": "c", "name": "issue_refund", "args": {}})
    assert langchain.content == tool_message_text(record)
    mcp = _result(record).content[0]
    assert getattr(mcp, "text", None) == tool_message_text(record)
    assert model_result(record)["dex_arguments_edit"] == NOTE
    failed = record.model_copy(update={"status": CallStatus.FAILED, "result": None,
                                       "error": "card declined"})
    assert tool_message_text(failed) == f"({NOTE})\ncard declined"
    plain = record.model_copy(update={"original_arguments": None})
    assert "dex_arguments_edit" not in model_result(plain)
    assert not tool_message_text(plain).startswith("(")
