"""Pydantic AI adapter (issue 10): ``DexCapability`` runs an agent's tool calls through dex-tasks.

Offline, with Pydantic AI's own ``FunctionModel`` playing the model, against real Redis and real
``dex-tasks worker`` processes; the ledger counts how often each tool really ran. This process
never imports the tool code: the tools come from the catalog the worker published.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic_ai import (
    Agent,
    DeferredToolRequests,
    DeferredToolResults,
    ToolApproved,
    ToolDenied,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dex_tasks import (
    APPROVAL_REJECTED,
    AsyncDexClient,
    CallStatus,
    ConfigurationError,
    DexClient,
    InvalidArgumentError,
    UnknownToolError,
)
from dex_tasks.integrations.pydantic_ai import (
    ApprovalPendingError,
    DexCapability,
    dex_deferred_results,
)
from tests.conftest import StartWorker
from tests.helpers import ROOT
from workers import ledger

T = TypeVar("T")
ORDER_1001 = {"order_id": "1001", "status": "shipped", "total_cents": 4599}
ORDER_1002 = {"order_id": "1002", "status": "processing", "total_cents": 1250}
REFUND = {"charge_id": "ch_1001", "amount_cents": 4599}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@dataclass
class Script:
    """A scripted model: ``turns[i]`` are the tool calls of its i-th response, then it replies
    "done". It records what it received, so tests can assert on what the model read."""

    turns: list[list[ToolCallPart]]
    received: list[ModelMessage] = field(default_factory=list)
    offered: list[list[str]] = field(default_factory=list)

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.received.append(messages[-1])
        self.offered.append(sorted(tool.name for tool in info.function_tools))
        made = sum(isinstance(message, ModelResponse) for message in messages)
        if made < len(self.turns):
            return ModelResponse(parts=list(self.turns[made]))
        return ModelResponse(parts=[TextPart("done")])

    def read(self) -> list[ToolReturnPart]:
        """Every tool result the model has been sent, in order."""
        return [part for message in self.received for part in message.parts
                if isinstance(part, ToolReturnPart)]


def call(tool: str, arguments: dict[str, Any], call_id: str = "call-1") -> ToolCallPart:
    return ToolCallPart(tool, arguments, tool_call_id=call_id)


def agent_with(script: Script, dex: DexCapability, **kwargs: Any) -> Agent[None, Any]:
    return Agent(FunctionModel(script), capabilities=[dex],
                 output_type=[str, DeferredToolRequests], **kwargs)


def executions(ledger_path: Path, tool: str) -> list[str]:
    """The keys of every execution of ``tool``, in order."""
    return [entry["key"] for entry in ledger.read(ledger_path) if entry["tool"] == tool]


@pytest.fixture
def worker(start_worker: StartWorker) -> None:
    start_worker(concurrency=2, tools="workers.example_tools")


def test_a_read_runs_on_a_worker_and_each_turn_gets_its_own_key(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    # Given a model that reuses the tool-call id "call-1" in two turns, as fake models do
    script = Script([[call("lookup_order", {"order_id": "1001"})],
                     [call("lookup_order", {"order_id": "1002"})]])
    agent = Agent(FunctionModel(script), capabilities=[DexCapability(client)])

    result = run(agent.run("Where are my orders?", conversation_id="support-1"))

    # Then each call ran once on a worker, and the model read each result
    assert result.output == "done"
    assert [part.content for part in script.read()] == [ORDER_1001, ORDER_1002]
    assert all(part.outcome == "success" for part in script.read())
    first, second = executions(ledger_path, "lookup_order")
    assert first != second
    # ... keyed by the conversation, the response that held the call, and the model's call id
    calls = client.get_agent_snapshot("support-1").tool_calls
    assert {c.key for c in calls} == {first, second}
    assert {c.tool_call_id for c in calls} == {"call-1"}
    assert len({c.turn_id for c in calls}) == 2
    assert all(c.status is CallStatus.SUCCEEDED for c in calls)
    # The model was offered the published tools, with the catalog's docstring as description
    assert "lookup_order" in script.offered[0] and "refund_payment" in script.offered[0]


def test_a_rejection_reaches_the_model_as_the_tools_result(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    script = Script([[call("lookup_order", {"order_id": "1001"})],
                     [call("refund_payment", REFUND)]])
    dex = DexCapability(client)
    paused = run(agent_with(script, dex).run("Refund order 1001", conversation_id="support-2"))

    # The refund needs approval: the run paused with Pydantic AI's deferred tool requests
    requests = paused.output
    assert isinstance(requests, DeferredToolRequests)
    [pending] = requests.approvals
    meta = requests.metadata[pending.tool_call_id]
    assert meta["dex_session_id"] == "support-2" and meta["dex_tool"] == "refund_payment"
    assert client.resolve_interrupt("support-2", meta["dex_interrupt_id"], False,
                                    rejection_message="refunds need a manager", approver="bob")

    results = run(dex.deferred_results(requests))
    denial = results.approvals[pending.tool_call_id]
    assert isinstance(denial, ToolDenied) and "refunds need a manager" in denial.message
    # The history alone gives the same answer, even with the earlier lookup exchange trimmed
    # away: a call's key does not depend on where its response sits in the history.
    history = paused.all_messages()
    trimmed = [history[0], *history[3:]]
    assert run(dex.deferred_results(trimmed)).approvals == results.approvals

    resumed = run(agent_with(script, dex).run(message_history=history,
                                              deferred_tool_results=results))
    assert resumed.output == "done"
    answer = script.read()[-1]
    assert answer.outcome == "denied"
    assert str(answer.content).startswith(APPROVAL_REJECTED)
    assert "rejected by bob: refunds need a manager" in str(answer.content)

    # An approval given outside dex-tasks is not trusted: dex-tasks' record still decides
    script.received.clear()
    forced = DeferredToolResults(approvals={pending.tool_call_id: ToolApproved()})
    run(agent_with(script, dex).run(message_history=history, deferred_tool_results=forced))
    [answer] = script.read()
    assert answer.outcome == "failed" and "refunds need a manager" in str(answer.content)
    assert executions(ledger_path, "refund_payment") == []


def test_a_pending_approval_is_not_resumed_and_an_approved_one_runs_once(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    # A conversation id dex-tasks cannot take as it is ("/", over 200 characters): it is mapped,
    # the same way in the agent and when the keys are rebuilt from the saved history.
    conversation = "tenant/7/" + "x" * 250
    # One response with two calls: the lookup runs at once, the refund waits for a person
    script = Script([[call("lookup_order", {"order_id": "1001"}, call_id="call-0"),
                      call("refund_payment", REFUND)]])
    dex = DexCapability(client)
    paused = run(agent_with(script, dex).run("Refund order 1001", conversation_id=conversation))
    history = paused.all_messages()
    assert isinstance(paused.output, DeferredToolRequests)
    session = paused.output.metadata["call-1"]["dex_session_id"]
    record = next(c for c in client.get_agent_snapshot(session).tool_calls
                  if c.tool == "refund_payment")
    assert "/" not in record.session_id and len(record.session_id) <= 200
    assert record.status is CallStatus.AWAITING_APPROVAL

    # Nobody decided yet: there is nothing to resume with
    with pytest.raises(ApprovalPendingError, match=record.interrupt_id or "?"):
        run(dex_deferred_results(client, history))
    # and an approval given outside dex-tasks only pauses the run again, on the same call
    again = run(agent_with(script, dex).run(
        message_history=history,
        deferred_tool_results=DeferredToolResults(approvals={"call-1": ToolApproved()})))
    assert isinstance(again.output, DeferredToolRequests)
    assert again.output.metadata["call-1"]["dex_key"] == record.key
    assert len(client.get_agent_snapshot(record.session_id).pending_interrupts) == 1

    assert client.resolve_interrupt(record.session_id, record.interrupt_id or "", True)
    # The keys rebuilt from the history alone find the approved call (and only it: the
    # lookup was answered before the run paused)
    results = run(dex_deferred_results(client, history))
    assert list(results.approvals) == ["call-1"]
    assert isinstance(results.approvals["call-1"], ToolApproved)
    for _ in range(2):  # resuming the same step twice
        resumed = run(agent_with(script, dex).run(message_history=history,
                                                  deferred_tool_results=results))
        assert resumed.output == "done"
    refunded = {"charge_id": "ch_1001", "refunded_cents": 4599}
    assert [p.content for p in script.read()] == [ORDER_1001, refunded] * 2
    assert executions(ledger_path, "refund_payment") == [record.key]
    assert len(executions(ledger_path, "lookup_order")) == 1


def test_a_call_that_outlasts_the_wait_is_deferred_and_resumed_without_running_again(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    script = Script([[call("lookup_order", {"order_id": "1001", "sleep": 1.5})]])
    dex = DexCapability(client, timeout=0.2)
    paused = run(agent_with(script, dex).run("Where is order 1001?"))

    # The call is still running on the worker: the run pauses instead of giving up on it
    requests = paused.output
    assert isinstance(requests, DeferredToolRequests)
    [deferred] = requests.calls
    key = requests.metadata[deferred.tool_call_id]["dex_key"]

    # (the async client works the same as the blocking one)
    slow = DexCapability(AsyncDexClient(client=client), timeout=30)
    results = run(slow.deferred_results(requests))
    resumed = run(agent_with(script, slow).run(message_history=paused.all_messages(),
                                               deferred_tool_results=results))
    assert resumed.output == "done"
    assert [p.content for p in script.read()] == [ORDER_1001]
    assert executions(ledger_path, "lookup_order") == [key]


def test_the_agents_own_tools_run_on_a_worker_or_are_refused(
    client: DexClient, worker: None, ledger_path: Path
) -> None:
    ran_here: list[str] = []
    script = Script([[call("lookup_order", {"order_id": "1002"}),
                      call("shout", {"text": "hi"}, call_id="call-2")]])
    agent = Agent(FunctionModel(script),
                  capabilities=[DexCapability(client, names=["lookup_order"],
                                              local_tools=["shout"])])

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, str]:
        """The agent's own lookup: dex-tasks routes it to the catalog tool of that name."""
        ran_here.append(order_id)
        return {"order_id": order_id, "from": "the agent process"}

    @agent.tool_plain
    def shout(text: str) -> str:
        """A tool that runs in the agent process, as local_tools allows."""
        return text.upper()

    result = run(agent.run("Where is order 1002?"))
    assert result.output == "done"
    # The worker ran the lookup; the agent's own function body never did
    assert ran_here == []
    assert [p.content for p in script.read()] == [ORDER_1002, "HI"]
    assert len(executions(ledger_path, "lookup_order")) == 1
    # names= offered only that catalog tool, next to the agent's own
    assert script.offered[0] == ["lookup_order", "shout"]

    # Without local_tools, a tool that would bypass dex-tasks stops the run before the model
    strict = Agent(FunctionModel(Script([])), capabilities=[DexCapability(client)])
    strict.tool_plain(shout)
    with pytest.raises(ConfigurationError, match="'shout'"):
        run(strict.run("hi"))
    # and a catalog name that is not published is named too
    unknown = Agent(FunctionModel(Script([])),
                    capabilities=[DexCapability(client, names=["no_such_tool"])])
    with pytest.raises(UnknownToolError, match="no_such_tool"):
        run(unknown.run("hi"))


def run_example(env: dict[str, str], history: Path) -> str:
    """Run ``examples/pydantic_ai_agent.py`` in a process of its own; its output."""
    proc = subprocess.run(
        [sys.executable, "examples/pydantic_ai_agent.py", "--history", str(history)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_example_pauses_exits_and_a_new_process_runs_the_approved_refund_once(
    client: DexClient, worker: None, env: dict[str, str], ledger_path: Path, tmp_path: Path
) -> None:
    history = tmp_path / "history.json"

    # The agent process looks the order up, asks to refund it, and exits while it waits
    out = run_example(env, history)
    found = re.search(r"paused: refund_payment\((.*)\) waits for approval: "
                      r"dex-tasks approvals approve (\S+) (\S+)", out)
    assert found, out
    assert json.loads(found.group(1)) == REFUND
    session, interrupt = found.group(2), found.group(3)
    assert history.exists()
    assert executions(ledger_path, "refund_payment") == []
    assert len(executions(ledger_path, "lookup_order")) == 1
    paused_history = tmp_path / "paused.json"
    shutil.copy(history, paused_history)

    # A person approves; a new process resumes from the saved history
    assert client.resolve_interrupt(session, interrupt, True, approver="alice")
    out = run_example(env, history)
    answer = 'answer: refund_payment success: {"charge_id":"ch_1001","refunded_cents":4599}'
    assert answer in out, out
    assert not history.exists()
    [refund_key] = executions(ledger_path, "refund_payment")

    # Resuming the same paused step again (a replayed resume) returns the same result and
    # starts nothing
    shutil.copy(paused_history, history)
    assert answer in run_example(env, history)
    assert executions(ledger_path, "refund_payment") == [refund_key]
    assert len(executions(ledger_path, "lookup_order")) == 1
    assert client.get_tool_call(refund_key).status is CallStatus.SUCCEEDED


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"timeout": 0}, "timeout"), ({"timeout": True}, "timeout"),
     ({"names": "lookup_order"}, "names"), ({"session_id": 42}, "session_id")],
)
def test_bad_arguments_are_refused_naming_them(
    client: DexClient, kwargs: dict[str, Any], names: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=names):
        DexCapability(client, **kwargs)
    with pytest.raises(InvalidArgumentError, match="client must be a DexClient"):
        DexCapability("redis://localhost")  # type: ignore[arg-type]


def test_without_the_extra_the_import_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pydantic_ai", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "dex_tasks.integrations.pydantic_ai")
    with pytest.raises(ImportError) as caught:
        importlib.import_module("dex_tasks.integrations.pydantic_ai")
    assert str(caught.value) == ("dex_tasks.integrations.pydantic_ai needs the pydantic-ai "
                                 'extra: pip install "dex-tasks[pydantic-ai]"')
