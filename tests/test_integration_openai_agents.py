"""The OpenAI Agents SDK adapter (issue 10): ``dex_function_tools`` and ``apply_dex_decisions``.

The model is the SDK's own ``agents.testing.ScriptedModel`` (offline, no API key, tracing off);
Redis, the store and the workers are real. What each test shows:

* a read runs on a worker and the model reads its result; call ids a fake model reuses from
  one turn to the next stay separate calls;
* re-running a step with the same ids never starts a tool twice, whatever its call id looks like;
* a call that needs approval pauses the run; the agent process exits; a person approves; a new
  process resumes and the tool runs once, however often the resume is replayed (the example);
* a rejection reaches the model as the tool's result, with the person's message;
* a call the tool's input guardrails refuse, or whose arguments the tool refuses, is never put
  to a person;
* approving in the SDK alone runs nothing: dex-tasks decides; interruptions of other tools are
  left to the caller.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    Runner,
    RunResult,
    RunState,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolInputGuardrailTripwireTriggered,
    UserError,
    function_tool,
    set_tracing_disabled,
    tool_input_guardrail,
)
from agents.items import TResponseOutputItem
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from dex_tasks import TOOL_DID_NOT_RUN, AsyncDexClient, CallStatus, DexClient, UnknownToolError
from dex_tasks.integrations.openai_agents import (
    ApprovalPendingError,
    apply_dex_decisions,
    dex_context,
    dex_function_tools,
)
from tests.conftest import StartWorker
from tests.helpers import ROOT
from workers import example_tools, ledger

# The example tools are registered in this process too (as when the whole suite runs), so the
# tests in which nothing may run need no worker to know them. The rest start a worker.
assert example_tools.refund_payment.name == "refund_payment"

set_tracing_disabled(True)  # offline: the SDK must not try to export traces

EXAMPLE = ROOT / "examples" / "openai_agents_agent.py"
ORDER_1001 = {"order_id": "1001", "status": "shipped", "total_cents": 4599}
ORDER_1002 = {"order_id": "1002", "status": "processing", "total_cents": 1250}


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2)


def tool_outputs(call: ModelCall) -> dict[str, str]:
    """What the model was given as tool results in one request, by call id."""
    return {item["call_id"]: item["output"] for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"}


def refund_model(charge_id: str, amount_cents: int) -> ScriptedModel:
    """Asks for one refund, then reports what the refund tool said."""

    def respond(call: ModelCall) -> list[TResponseOutputItem]:
        seen = tool_outputs(call)
        if "call_refund" not in seen:
            return [function_call("refund_payment",
                                  {"charge_id": charge_id, "amount_cents": amount_cents},
                                  call_id="call_refund")]
        return [assistant_message(f"refund said: {seen['call_refund']}")]

    return ScriptedModel([ModelStep.respond(respond) for _ in range(3)])


def run(agent: Agent[Any], text: str, context: dict[str, str]) -> RunResult:
    return asyncio.run(Runner.run(agent, text, context=context))


def tools_by_name(client: DexClient, names: list[str] | None = None) -> dict[str, FunctionTool]:
    tools = dex_function_tools(client, names)
    assert all(isinstance(t, FunctionTool) for t in tools)
    return {t.name: t for t in tools if isinstance(t, FunctionTool)}


# -- tools from the catalog, and reads -----------------------------------------------------------


def test_a_read_runs_on_a_worker_and_the_model_reads_its_result(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    # The catalog the worker published becomes FunctionTools; policies decide needs_approval,
    # and a schema is sent strict only when strict mode would not change what it accepts.
    tools = tools_by_name(client)
    lookup, refund = tools["lookup_order"], tools["refund_payment"]
    assert lookup.description == "Look up an order by id."
    assert lookup.params_json_schema["required"] == ["order_id"]
    assert (lookup.needs_approval, lookup.strict_json_schema) == (False, False)  # `sleep` optional
    assert (refund.needs_approval, refund.strict_json_schema) == (True, True)
    assert tools["charge_card"].needs_approval is False  # its policy says no approval
    assert list(tools_by_name(client, ["refund_payment", "lookup_order"])) == [
        "refund_payment", "lookup_order"]
    with pytest.raises(UnknownToolError, match="no_such_tool"):
        dex_function_tools(client, ["lookup_order", "no_such_tool"])

    # Turn t1 reads order 1001 with call id "call_1"; turn t2 (through the async client) reads
    # order 1002 with the same call id, as fake models do: two calls, two results.
    for turn, order, dex in (("t1", ORDER_1001, client),
                             ("t2", ORDER_1002, AsyncDexClient(client=client))):
        model = ScriptedModel([
            [function_call("lookup_order", {"order_id": order["order_id"]}, call_id="call_1")],
            [assistant_message("looked it up")],
        ])
        agent = Agent(name="support", model=model, tools=dex_function_tools(dex, ["lookup_order"]))
        result = run(agent, "Where is my order?", {"session_id": "s1", "turn_id": turn})

        assert result.final_output == "looked it up"
        assert json.loads(tool_outputs(model.calls[1])["call_1"]) == order
        record = client.get_tool_call(f"s1/{turn}/call_1")
        assert record.status is CallStatus.SUCCEEDED and record.result == order
    assert ledger.executions(ledger_path) == {"s1/t1/call_1": 1, "s1/t2/call_1": 1}

    # Without a session and a turn there is no key: the run stops with an error that says how.
    model = ScriptedModel([[function_call("lookup_order", {"order_id": "1001"}, call_id="c9")]])
    agent = Agent(name="support", model=model, tools=dex_function_tools(client, ["lookup_order"]))
    with pytest.raises(UserError, match=r"no session_id: pass context=dex_context"):
        asyncio.run(Runner.run(agent, "Where is my order?"))
    assert sum(ledger.executions(ledger_path).values()) == 2


def test_rerunning_a_step_never_starts_its_tool_twice(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    # Call ids that cannot be part of a key as they are (a "/", 300 characters) map to the
    # same short id every time.
    odd_id = "call/" + "x" * 300
    context = dex_context("s2")
    outputs = []
    for _ in range(2):
        model = ScriptedModel([
            [function_call("charge_card", {"customer_id": "cus_1", "amount_cents": 700},
                           call_id=odd_id)],
            [assistant_message("charged")],
        ])
        agent = Agent(name="billing", model=model, tools=dex_function_tools(client))
        assert run(agent, "Charge 7 euros", context).final_output == "charged"
        outputs.append(tool_outputs(model.calls[1])[odd_id])

    # Given the same session, turn and call id twice, the card was charged once and the
    # model read the same charge both times.
    assert outputs[0] == outputs[1] and json.loads(outputs[0])["charged_cents"] == 700
    executions = ledger.executions(ledger_path)
    assert list(executions.values()) == [1]
    (key,) = executions
    session_id, turn_id, tool_call_id = key.split("/")
    assert (session_id, turn_id) == (context["session_id"], context["turn_id"])
    assert tool_call_id.startswith("call~2fxxx") and len(tool_call_id) <= 160

    # Within one run the SDK itself never treats one call id as two calls: a model that
    # repeats a call with its id in the next response does not run the tool again.
    model = ScriptedModel([
        [function_call("lookup_order", {"order_id": "1001"}, call_id="call_again")],
        [function_call("lookup_order", {"order_id": "1001"}, call_id="call_again")],
        [assistant_message("done")],
    ])
    agent = Agent(name="support", model=model, tools=dex_function_tools(client, ["lookup_order"]))
    assert run(agent, "Look twice", {"session_id": "s2", "turn_id": "t9"}).final_output == "done"
    assert ledger.executions(ledger_path)["s2/t9/call_again"] == 1


# -- approvals ------------------------------------------------------------------------------------


def run_example(
    env: dict[str, str], state: Path, session_id: str
) -> subprocess.CompletedProcess[str]:
    """Run the example agent as its own process, as a user would."""
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--state", str(state),
         "--session", session_id],
        cwd=ROOT, env={**env, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
        capture_output=True, text=True, timeout=90,
    )


def load_example() -> ModuleType:
    """The example as a module, to run its agent in this process."""
    spec = importlib.util.spec_from_file_location("openai_agents_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_approved_refund_survives_the_agent_process_and_runs_once(
    client: DexClient, worker: None, env: dict[str, str], ledger_path: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = tmp_path / "run.json"

    # Given an agent process that reads an order and asks to refund it: the read runs, the
    # refund waits for a person, and the process saves the run and exits.
    first = run_example(env, state, "sb")
    assert first.returncode == 3, first.stdout + first.stderr
    assert "waiting for a person: refund_payment" in first.stdout
    assert ledger.executions(ledger_path) == {"sb/turn-1/call_lookup": 1}
    (pending,) = client.get_agent_snapshot("sb").pending_interrupts
    assert (pending.tool, pending.arguments) == (
        "refund_payment", {"charge_id": "ch_1001", "amount_cents": 4599})
    paused = tmp_path / "paused-copy.json"
    shutil.copy(state, paused)

    # When a person approves and a new process resumes the run,
    assert client.resolve_interrupt("sb", pending.interrupt_id, True, approver="alice")
    second = run_example(env, state, "sb")

    # then the refund ran once and the model read its result.
    assert second.returncode == 0, second.stdout + second.stderr
    assert 'refund tool said {"charge_id": "ch_1001", "refunded_cents": 4599}' in second.stdout
    assert not state.exists()

    # Replaying the resume from the same paused state (here, in this third process) runs
    # nothing again, and the model reads the same result.
    shutil.copy(paused, state)
    example = load_example()
    assert asyncio.run(example.run(client, state, "sb", "1001")) == 0
    assert capsys.readouterr().out == second.stdout
    assert ledger.executions(ledger_path) == {"sb/turn-1/call_lookup": 1,
                                              "sb/turn-1/call_refund": 1}


def test_a_rejection_reaches_the_model_with_the_persons_message(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    model = refund_model("ch_77", 2500)
    agent = Agent(name="support", model=model, tools=dex_function_tools(client))
    result = run(agent, "Refund ch_77", {"session_id": "sc", "turn_id": "t1"})
    assert [item.name for item in result.interruptions] == ["refund_payment"]
    paused = result.to_state()

    # Recording the call twice asks the person once.
    for _ in range(2):
        assert len(asyncio.run(apply_dex_decisions(paused, client))) == 1
    (pending,) = client.get_agent_snapshot("sc").pending_interrupts
    assert client.resolve_interrupt("sc", pending.interrupt_id, False,
                                    rejection_message="refunds need the order number",
                                    approver="bob")

    # The decision is applied to the run as saved and restored, the way another process would.
    async def resume() -> RunResult:
        restored = await RunState.from_string(agent, paused.to_string())
        assert await apply_dex_decisions(restored, client) == []
        return await Runner.run(agent, restored)

    final = asyncio.run(resume())
    told = tool_outputs(model.calls[-1])["call_refund"]
    assert told.startswith("APPROVAL_REJECTED") and "rejected by bob" in told
    assert "refunds need the order number" in told
    assert final.final_output == f"refund said: {told}"
    assert client.get_tool_call("sc/t1/call_refund").status is CallStatus.REJECTED
    assert ledger.executions(ledger_path) == {}


def test_input_guardrails_refuse_a_call_before_a_person_is_asked(
    client: DexClient, ledger_path: Path
) -> None:
    # No worker: nothing here may run. The tools come from this process's registry.
    @tool_input_guardrail
    def small_refunds_only(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        arguments = json.loads(data.context.tool_arguments)
        if arguments["charge_id"] == "ch_fraud":
            return ToolGuardrailFunctionOutput.raise_exception(output_info="fraud")
        if arguments["amount_cents"] > 10_000:
            return ToolGuardrailFunctionOutput.reject_content("refunds above 100.00 need a manager")
        return ToolGuardrailFunctionOutput.allow()

    def guarded_agent(model: ScriptedModel) -> Agent[Any]:
        tools = tools_by_name(client, ["refund_payment"])
        tools["refund_payment"].tool_input_guardrails = [small_refunds_only]
        return Agent(name="support", model=model, tools=list(tools.values()))

    # The SDK asks needs_approval before the tool's guardrails: the run pauses even for a
    # refund the guardrail refuses.
    model = refund_model("ch_1", 50_000)
    agent = guarded_agent(model)
    paused = run(agent, "Refund 500", {"session_id": "sg", "turn_id": "big"}).to_state()
    assert len(paused.get_interruptions()) == 1

    # apply_dex_decisions runs the guardrail first: nothing is recorded, nobody is asked, and
    # the model reads the guardrail's message.
    assert asyncio.run(apply_dex_decisions(paused, client)) == []
    snapshot = client.get_agent_snapshot("sg")
    assert snapshot.tool_calls == [] and snapshot.pending_interrupts == []
    final = asyncio.run(Runner.run(agent, paused))
    assert final.final_output == "refund said: refunds above 100.00 need a manager"

    # A guardrail that raises stops the run as the SDK would, still before anyone is asked.
    agent = guarded_agent(refund_model("ch_fraud", 100))
    paused = run(agent, "Refund it", {"session_id": "sg", "turn_id": "fraud"}).to_state()
    with pytest.raises(ToolInputGuardrailTripwireTriggered):
        asyncio.run(apply_dex_decisions(paused, client))
    assert client.get_agent_snapshot("sg").tool_calls == []

    # A refund the guardrail allows is put to a person.
    agent = guarded_agent(refund_model("ch_2", 100))
    paused = run(agent, "Refund 1", {"session_id": "sg", "turn_id": "small"}).to_state()
    assert len(asyncio.run(apply_dex_decisions(paused, client))) == 1
    (pending,) = client.get_agent_snapshot("sg").pending_interrupts
    assert pending.key == "sg/small/call_refund"
    assert ledger.executions(ledger_path) == {}


def test_approving_in_the_sdk_alone_runs_nothing(client: DexClient, ledger_path: Path) -> None:
    # No worker: nothing here may run (the call must not even be queued).
    agent = Agent(name="support", model=refund_model("ch_3", 300),
                  tools=dex_function_tools(client))
    paused = run(agent, "Refund 3", {"session_id": "sa", "turn_id": "t1"}).to_state()
    (item,) = paused.get_interruptions()

    # Given an approval made on the RunState only, nobody having decided in dex-tasks,
    paused.approve(item)
    # when the run resumes, the tool does not run: the call waits for a person. The error is
    # the adapter's own (an AgentsException the SDK passes on, not a UserError), and the run
    # stays resumable: the paused state is intact and the call is recorded.
    with pytest.raises(ApprovalPendingError, match="awaits a person's approval") as raised:
        asyncio.run(Runner.run(agent, paused))
    assert not isinstance(raised.value, UserError)
    assert [i.call_id for i in paused.get_interruptions()] == [item.call_id]
    record = client.get_tool_call("sa/t1/call_refund")
    assert record.status is CallStatus.AWAITING_APPROVAL
    assert ledger.executions(ledger_path) == {}


def test_arguments_the_tool_refuses_are_never_put_to_a_person(
    client: DexClient, ledger_path: Path
) -> None:
    # No worker: nothing here may run. The model sends a string where the refund needs cents.
    model = ScriptedModel([
        [function_call("refund_payment", {"charge_id": "ch_4", "amount_cents": "lots"},
                       call_id="call_refund")],
        ModelStep.respond(lambda call: [assistant_message(tool_outputs(call)["call_refund"])]),
    ])
    agent = Agent(name="support", model=model, tools=dex_function_tools(client))
    paused = run(agent, "Refund it", {"session_id": "sv", "turn_id": "t1"}).to_state()

    assert asyncio.run(apply_dex_decisions(paused, client)) == []
    assert client.get_agent_snapshot("sv").pending_interrupts == []
    final = asyncio.run(Runner.run(agent, paused))
    assert final.final_output.startswith(TOOL_DID_NOT_RUN) and "amount_cents" in final.final_output
    assert client.get_tool_call("sv/t1/call_refund").status is CallStatus.FAILED
    assert ledger.executions(ledger_path) == {}


def test_interruptions_of_other_tools_are_left_to_the_caller(client: DexClient) -> None:
    @function_tool(needs_approval=True)
    def close_account(customer_id: str) -> str:
        """Close a customer's account (a plain SDK tool, not a dex one)."""
        return f"closed {customer_id}"

    model = ScriptedModel([
        [function_call("close_account", {"customer_id": "cus_9"}, call_id="call_close")],
        [assistant_message("closed")],
    ])
    agent = Agent(name="support", model=model,
                  tools=[*dex_function_tools(client, ["lookup_order"]), close_account])
    paused = run(agent, "Close my account", {"session_id": "so", "turn_id": "t1"}).to_state()

    # Undecided until the caller decides it on the state; dex-tasks records nothing for it.
    (item,) = asyncio.run(apply_dex_decisions(paused, client))
    assert item.name == "close_account"
    assert client.get_agent_snapshot("so").tool_calls == []
    paused.approve(item)
    assert asyncio.run(apply_dex_decisions(paused, client)) == []
    assert asyncio.run(Runner.run(agent, paused)).final_output == "closed"
