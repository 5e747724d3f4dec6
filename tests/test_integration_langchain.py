"""The LangChain / LangGraph adapter (issue 10) against real Redis and real workers.

The agents are ``langchain.agents.create_agent`` graphs driven by LangChain's own fake chat
model (``tests.langchain_agent_proc.ScriptedChatModel``), so everything runs offline; the tools
run on ``dex-tasks worker`` processes serving ``workers.example_tools``, whose ledger counts
every execution.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from dex_tasks import (
    APPROVAL_REJECTED,
    AsyncDexClient,
    CallStatus,
    DexClient,
    InvalidArgumentError,
    InvalidCallError,
    UnknownToolError,
)
from dex_tasks.integrations.langchain import (
    DEX_APPROVAL,
    DexMiddleware,
    apply_decisions,
    dex_tools,
    key_part,
    resume_command,
)
from tests.conftest import StartWorker
from tests.helpers import ROOT, wait_until
from tests.langchain_agent_proc import ScriptedChatModel, ai
from workers import ledger


def config_of(thread: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread}}


def ai_ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages if isinstance(m, AIMessage)]


def run_python(args: list[str], env: dict[str, str], timeout: float = 90) -> str:
    """Run a Python agent process in the repo root; its stdout (it must exit 0)."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


@lc_tool
def lookup_order(order_id: str) -> str:
    """Look up an order by id (the agent's own tool: under DexMiddleware a worker runs it)."""
    raise AssertionError("the agent process ran a tool's code")


def test_a_read_runs_on_a_worker_its_result_reaches_the_model_and_reused_call_ids_do_not_collide(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker()
    # Given an agent with its own tool and a fake model that, like many test models, gives
    # every turn's call the id "call_1" (and once names a tool nobody has).
    model = ScriptedChatModel(messages=iter([
        ai(("lookup_order", {"order_id": "1001"}, "call_1")),
        ai(("lookup_order", {"order_id": "1002"}, "call_1"), ("lookup_pizza", {}, "call_2")),
        AIMessage("Both orders found."),
    ]))
    agent = create_agent(model, tools=[lookup_order], middleware=[DexMiddleware(client)],
                         checkpointer=InMemorySaver())

    result = agent.invoke({"messages": [("user", "Where are my orders?")]}, config_of("th-a"))

    # The model read each result as the tool's message.
    first, (second, unknown) = model.received[1][-1], model.received[2][-2:]
    assert isinstance(first, ToolMessage) and isinstance(second, ToolMessage)
    assert json.loads(str(first.content)) == {"order_id": "1001", "status": "shipped",
                                              "total_cents": 4599}
    assert json.loads(str(second.content))["status"] == "processing"
    assert isinstance(unknown, ToolMessage) and unknown.status == "error"
    assert "unknown tool 'lookup_pizza'" in str(unknown.content)
    assert result["messages"][-1].content == "Both orders found."
    # Each call ran once, keyed by thread / AI message / tool-call id: the reused "call_1" of
    # two turns made two calls, not one call with conflicting arguments.
    turn1, turn2, _ = ai_ids(result["messages"])
    keys = [f"th-a/{turn1}/call_1", f"th-a/{turn2}/call_1"]
    assert first.artifact == {"key": keys[0], "status": "succeeded"}
    assert ledger.executions(ledger_path) == {keys[0]: 1, keys[1]: 1}

    # Catalog tools (this process has no code for them) in a graph without the middleware:
    # the model is offered the published schema and docstring, and each tool runs its call
    # through dex-tasks itself.
    model = ScriptedChatModel(messages=iter([ai(("lookup_order", {"order_id": "1001"}, "c9")),
                                             AIMessage("ok")]))
    (tool,) = dex_tools(client, ["lookup_order"])
    published = {spec.name: spec for spec in client.list_tools()}["lookup_order"]
    assert tool.args_schema == published.parameters
    plain = create_agent(model, tools=[tool], checkpointer=InMemorySaver())
    messages = plain.invoke({"messages": [("user", "again")]}, config_of("th-b"))["messages"]
    (offered,) = model.offered
    assert offered["function"]["description"] == "Look up an order by id."
    assert offered["function"]["parameters"]["required"] == ["order_id"]
    assert set(offered["function"]["parameters"]["properties"]) == {"order_id", "sleep"}
    assert json.loads(str(model.received[-1][-1].content))["status"] == "shipped"
    assert ledger.executions(ledger_path)[f"th-b/{ai_ids(messages)[0]}/c9"] == 1


def test_approval_pauses_the_graph_the_process_exits_and_a_new_process_resumes_it(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path,
) -> None:
    start_worker()
    checkpoints = tmp_path / "agent.sqlite"
    example = ["examples/langchain_agent.py", "--thread", "th-refund",
               "--checkpoints", str(checkpoints)]

    # The example agent looks the order up, asks for the refund, pauses and exits.
    out = run_python(example, env)
    (pending,) = client.get_agent_snapshot("th-refund").pending_interrupts
    assert pending.tool == "refund_payment"
    assert f"interrupt {pending.interrupt_id}" in out
    assert [e["tool"] for e in ledger.read(ledger_path)] == ["lookup_order"]

    # A person approves while no agent process runs; a new process resumes the graph.
    assert client.resolve_interrupt("th-refund", pending.interrupt_id, approved=True,
                                    approver="alice")
    out = run_python(example, env)
    assert "resuming thread th-refund" in out
    assert ledger.executions(ledger_path)[pending.key] == 1
    assert [e["tool"] for e in ledger.read(ledger_path)] == ["lookup_order", "refund_payment"]

    # What the model read last (from the checkpoint): the refund's result as the tool message.
    with SqliteSaver.from_conn_string(str(checkpoints)) as saver:
        agent = create_agent(ScriptedChatModel(messages=iter(())), tools=dex_tools(client),
                             middleware=[DexMiddleware(client)], checkpointer=saver)
        messages = agent.get_state(config_of("th-refund")).values["messages"]
    *read_by_model, answer = messages
    assert isinstance(answer, AIMessage) and "handled" in str(answer.content)
    assert isinstance(read_by_model[-1], ToolMessage)
    assert json.loads(str(read_by_model[-1].content)) == {"charge_id": "ch_1001",
                                                          "refunded_cents": 4599}


def test_a_rejection_reaches_the_model_and_a_premature_or_forged_resume_approves_nothing(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker()
    aclient = AsyncDexClient(client=client)
    model = ScriptedChatModel(messages=iter([
        ai(("refund_payment", {"charge_id": "ch_1", "amount_cents": 100}, "call_a"),
           ("refund_payment", {"charge_id": "ch_2", "amount_cents": 20000}, "call_b")),
        AIMessage("One refund done, one refused."),
    ]))
    agent = create_agent(model, tools=dex_tools(aclient), middleware=[DexMiddleware(aclient)],
                         checkpointer=InMemorySaver())
    config = config_of("th-c")

    async def scenario() -> dict[str, Any]:
        # Two calls that need approval: the graph pauses with one dex interrupt for each.
        result = await agent.ainvoke({"messages": [("user", "refund both")]}, config)
        values = [i.value for i in result["__interrupt__"]]
        assert sorted(v["tool_call_id"] for v in values) == ["call_a", "call_b"]
        assert all(v["type"] == DEX_APPROVAL and v["session_id"] == "th-c" for v in values)
        by_call = {v["tool_call_id"]: v for v in values}

        # A resume value that claims approval, before anyone decided: the graph pauses again.
        state = await agent.aget_state(config)
        forged = Command(resume={i.id: {"approved": True} for i in state.interrupts})
        again = await agent.ainvoke(forged, config)
        assert len(again["__interrupt__"]) == 2
        again = await agent.ainvoke(resume_command(await agent.aget_state(config)), config)
        assert len(again["__interrupt__"]) == 2
        for value in values:
            record = await aclient.get_tool_call(value["key"])
            assert record.status is CallStatus.AWAITING_APPROVAL

        # A person approves one and rejects the other; the graph continues.
        assert await aclient.resolve_interrupt("th-c", by_call["call_a"]["interrupt_id"], True)
        assert await aclient.resolve_interrupt(
            "th-c", by_call["call_b"]["interrupt_id"], False,
            rejection_message="refunds over $100 need a manager", approver="bob")
        done = await agent.ainvoke(resume_command(await agent.aget_state(config)), config)
        assert "__interrupt__" not in done
        done["keys"] = {c: v["key"] for c, v in by_call.items()}
        return done

    done = asyncio.run(scenario())
    read = {m.tool_call_id: m for m in model.received[-1] if isinstance(m, ToolMessage)}
    assert json.loads(str(read["call_a"].content)) == {"charge_id": "ch_1", "refunded_cents": 100}
    rejected = str(read["call_b"].content)
    assert read["call_b"].status == "error"
    assert rejected.startswith(APPROVAL_REJECTED)
    assert "bob" in rejected and "refunds over $100 need a manager" in rejected
    assert ledger.executions(ledger_path) == {done["keys"]["call_a"]: 1}


def test_langchains_own_edit_and_reject_decisions_are_recorded_in_dex_and_resume_the_graph(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker()
    model = ScriptedChatModel(messages=iter([
        ai(("refund_payment", {"charge_id": "ch_1", "amount_cents": 50000}, "call_a"),
           ("refund_payment", {"charge_id": "ch_2", "amount_cents": 700}, "call_b")),
        AIMessage("Done."),
    ]))
    agent = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                         checkpointer=InMemorySaver())
    config = config_of("th-hitl")
    # Given a graph paused on two dex approvals
    paused = agent.invoke({"messages": [("user", "refund both")]}, config)
    keys = {i.value["tool_call_id"]: i.value["key"] for i in paused["__interrupt__"]}
    state = agent.get_state(config)
    order = [i.value["tool_call_id"] for i in state.interrupts]
    edit = {"type": "edit", "edited_action": {"name": "refund_payment",
                                              "args": {"charge_id": "ch_1",
                                                       "amount_cents": 9000}}}
    reject = {"type": "reject", "message": "ch_2 was refunded by phone"}
    # When a decision is malformed, then nothing is recorded
    with pytest.raises(InvalidArgumentError, match="respond"):
        apply_decisions(client, state, [edit, {"type": "respond", "message": "x"}])
    with pytest.raises(InvalidArgumentError, match="not the tool"):
        apply_decisions(client, state, [{**edit, "edited_action": {"name": "charge_card",
                                                                    "args": {}}}, reject])
    assert {client.get_tool_call(k).status for k in keys.values()} == {
        CallStatus.AWAITING_APPROVAL}
    # When the person's LangChain decisions (edit one, reject the other) are applied
    by_call = {"call_a": edit, "call_b": reject}
    done = agent.invoke(apply_decisions(client, state, [by_call[c] for c in order],
                                        approver="alice"), config)
    # Then the edited refund ran once, with the edited amount, and the model read both
    assert "__interrupt__" not in done
    assert ledger.executions(ledger_path) == {keys["call_a"]: 1}
    edited = client.get_tool_call(keys["call_a"])
    assert edited.arguments == {"charge_id": "ch_1", "amount_cents": 9000}
    assert edited.original_arguments == {"charge_id": "ch_1", "amount_cents": 50000}
    read = {m.tool_call_id: str(m.content) for m in model.received[-1]
            if isinstance(m, ToolMessage)}
    assert "9000" in read["call_a"] and "50000" in read["call_a"]  # the edit note
    assert read["call_b"].startswith(APPROVAL_REJECTED)
    assert "ch_2 was refunded by phone" in read["call_b"]


class CountingMiddleware(DexMiddleware):
    """DexMiddleware that counts how often the tool node ran each tool call through it."""

    def __init__(self, client: DexClient) -> None:
        super().__init__(client)
        self.runs: Counter[str] = Counter()

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        self.runs[request.tool_call["id"]] += 1
        return super().wrap_tool_call(request, handler)


def test_replaying_the_tool_step_from_its_checkpoint_never_starts_a_tool_twice(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker()
    model = ScriptedChatModel(messages=iter([
        ai(("charge_card", {"customer_id": "cus_1", "amount_cents": 500}, "call_1"),
           ("refund_payment", {"charge_id": "ch_9", "amount_cents": 300}, "call_2")),
        AIMessage("done"), AIMessage("done again"), AIMessage("done a third time"),
    ]))
    middleware = CountingMiddleware(client)
    agent = create_agent(model, tools=dex_tools(client), middleware=[middleware],
                         checkpointer=InMemorySaver())
    config = config_of("th-d")
    paused = agent.invoke({"messages": [("user", "charge, then refund")]}, config)
    (interrupt,) = paused["__interrupt__"]
    assert client.resolve_interrupt("th-d", interrupt.value["interrupt_id"], True)
    first = agent.invoke(resume_command(agent.get_state(config)), config)
    charged = ledger.executions(ledger_path)
    assert sorted(charged.values()) == [1, 1]

    # Re-run the tool step twice from the checkpoint taken before it (LangGraph time travel
    # forks the thread and executes the step again): the same ids give the same keys.
    (before_tools,) = [s for s in agent.get_state_history(config) if set(s.next) == {"tools"}]
    runs_before = middleware.runs.copy()
    for _ in range(2):
        replay = agent.invoke(None, before_tools.config)
        assert [m.content for m in replay["messages"] if isinstance(m, ToolMessage)] == \
            [m.content for m in first["messages"] if isinstance(m, ToolMessage)]
    # Both calls went through the tool node again, twice; neither tool started again.
    assert middleware.runs - runs_before == {"call_1": 2, "call_2": 2}
    assert ledger.executions(ledger_path) == charged


def test_a_tool_node_that_stops_waiting_is_re_invoked_and_waits_for_the_same_call(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker()
    model = ScriptedChatModel(messages=iter([
        ai(("charge_card", {"customer_id": "cus_3", "amount_cents": 300, "sleep": 2.0},
            "call_1")),
        AIMessage("charged"),
    ]))
    agent = create_agent(model, tools=dex_tools(client),
                         middleware=[DexMiddleware(client, wait_timeout=0.5)],
                         checkpointer=InMemorySaver())
    config = config_of("th-t")
    with pytest.raises(TimeoutError, match="invoke the agent again"):
        agent.invoke({"messages": [("user", "charge")]}, config)

    # The charge goes on without the agent. Each re-invocation re-runs the tool step, which
    # waits (half a second) on the same call, until it has ended.
    def finished() -> dict[str, Any] | None:
        try:
            return agent.invoke(None, config)
        except TimeoutError:
            return None

    result = wait_until(finished, 60, "the charge to end")
    assert result["messages"][-1].content == "charged"
    assert json.loads(str(model.received[-1][-1].content))["charged_cents"] == 300
    key = f"th-t/{ai_ids(result['messages'])[0]}/call_1"
    assert ledger.executions(ledger_path) == {key: 1}


def test_an_agent_killed_while_its_tool_runs_is_re_invoked_without_running_the_tool_again(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path,
) -> None:
    # langgraph#7417: a step re-executed from its checkpoint must not start its tool again.
    start_worker()
    checkpoints = str(tmp_path / "agent.sqlite")
    script = json.dumps([
        {"tool_calls": [{"name": "charge_card", "id": "call_1",
                         "args": {"customer_id": "cus_7", "amount_cents": 700, "sleep": 1.5}}]},
        {"content": "charged"},
    ])
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "tests.langchain_agent_proc", checkpoints, "th-kill", script],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # When the charge has started on the worker, the agent process dies (SIGKILL).
        started = wait_until(
            lambda: [e for e in ledger.read(ledger_path) if e["tool"] == "charge_card"],
            60, "the charge to start")
        os.kill(agent.pid, signal.SIGKILL)
        assert agent.wait(10) == -signal.SIGKILL
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
    key = started[0]["key"]
    assert client.wait(key, 30).status is CallStatus.SUCCEEDED

    # Another process (this one) re-invokes the thread from its checkpoint: the tool step runs
    # again and finds the call by its key.
    model = ScriptedChatModel(messages=iter([AIMessage("charged")]))
    with SqliteSaver.from_conn_string(checkpoints) as saver:
        resumed = create_agent(model, tools=dex_tools(client), middleware=[DexMiddleware(client)],
                               checkpointer=saver)
        messages = resumed.invoke(None, config_of("th-kill"), durability="sync")["messages"]
    (turn, _) = ai_ids(messages)
    assert key == f"th-kill/{turn}/call_1"
    read = model.received[-1][-1]
    assert isinstance(read, ToolMessage) and json.loads(str(read.content))["charged_cents"] == 700
    assert ledger.executions(ledger_path)[key] == 1
    assert messages[-1].content == "charged"


# -- ids, errors, and the missing extra (no worker needed) -------------------------------------


def test_framework_ids_map_to_valid_deterministic_key_parts() -> None:
    assert key_part("lc_run--019a-0") == "lc_run--019a-0"
    slashed = key_part("user/42")
    assert slashed == "user~2f42" and slashed == key_part("user/42")
    assert key_part("user/42") != key_part("user_42")
    long_id = "x" * 500
    assert len(key_part(long_id)) <= 160 and key_part(long_id) != key_part("x" * 499)
    assert "\x00" not in key_part("a\x00b") and "/" not in key_part("\ud800/")


def test_bad_use_gets_errors_naming_what_is_wrong(client: DexClient) -> None:
    agent = create_agent(
        ScriptedChatModel(messages=iter([ai(("lookup_order", {"order_id": "1"}, "c1"))])),
        tools=[], middleware=[DexMiddleware(client)])
    with pytest.raises(InvalidCallError, match="needs a thread id"):
        agent.invoke({"messages": [("user", "hi")]})
    with pytest.raises(UnknownToolError, match="no_such_tool"):
        dex_tools(client, ["no_such_tool"])
    with pytest.raises(InvalidArgumentError, match="client must be a DexClient"):
        DexMiddleware("redis://")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="wait_timeout"):
        DexMiddleware(client, wait_timeout=0)


def test_the_module_names_the_extra_when_the_framework_is_missing() -> None:
    code = ("import sys; sys.modules['langgraph'] = None\n"
            "import dex_tasks.integrations.langchain")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert ('ImportError: dex_tasks.integrations.langchain needs the langchain extra: '
            'pip install "dex-tasks[langchain]"') in done.stderr
