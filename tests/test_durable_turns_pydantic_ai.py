"""Durable turns with Pydantic AI (issue 18): an agent process SIGKILLed anywhere and started
again the plain way (``agent.run(same input, capabilities=[DexCapability(client,
session_id=same)])``, no history saved) never runs its tool twice and never asks the model a
decision twice.

Real ``dex-tasks worker`` processes, Pydantic AI's own ``FunctionModel`` in a real agent
subprocess (``tests/pydantic_durable_agent.py``), which is SIGKILLed at each point DESIGN.md
lists: before the model answered, after it answered and before the call was sent, while the
tool runs, while the call awaits approval, after the tool ended and before the model read its
result. The ledger counts the tool's starts; the model's log its decisions.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from dex_tasks import CallStatus, DexClient, MessageRole
from dex_tasks.integrations.pydantic_ai import DexCapability, TurnInProgressError
from tests.conftest import StartWorker
from tests.helpers import ROOT, wait_until
from workers import ledger

CHARGE = {"customer_id": "cu_1", "amount_cents": 500}
SLOW_CHARGE = {**CHARGE, "sleep": 4.0}  # long enough to kill the agent while it runs
REFUND = {"charge_id": "ch_1", "amount_cents": 500}

# Each story: the tool and its arguments, then where each process of the agent dies; a last
# process runs to the end. Together they cover every kill point, with two and three restarts.
STORIES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "model-dispatch-after_tool": ("charge_card", CHARGE, ["model", "dispatch", "after_tool"]),
    "tool-after_tool": ("charge_card", SLOW_CHARGE, ["tool", "after_tool"]),
    "approval-approval": ("refund_payment", REFUND, ["approval", "approval"]),
}


class AgentProcess:
    """One run of ``tests/pydantic_durable_agent.py``."""

    def __init__(self, env: dict[str, str], session: str, tool: str, args: dict[str, Any],
                 model_log: Path, kill_at: str, out: Path) -> None:
        self.out = out
        with open(out, "wb") as stdout:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.pydantic_durable_agent", session, tool,
                 json.dumps(args), str(model_log), kill_at],
                cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


# make test's representative of the stories: killed while the tool runs, one restart to the end.
SHORT_STORIES = {"tool": ("charge_card", SLOW_CHARGE, ["tool"])}


def _story(name: str, client: DexClient, env: dict[str, str], ledger_path: Path,
           tmp_path: Path) -> tuple[str, list[dict[str, Any]], str]:
    """Run one story's processes; the session, the model's log and the last output."""
    tool, args, kills = STORIES[name] if name in STORIES else SHORT_STORIES[name]
    session = f"s-{name}"
    model_log = tmp_path / f"{name}.model.jsonl"
    for n, kill_at in enumerate([*kills, "none"]):
        agent = AgentProcess(env, session, tool, args, model_log, kill_at,
                             tmp_path / f"{name}.{n}.out")
        try:
            _await_its_end(agent, kill_at, session, ledger_path)
        finally:
            if agent.proc.poll() is None:
                agent.kill()
        if kill_at == "none":
            assert agent.proc.returncode == 0, agent.output()
            return session, ledger.read(model_log), agent.output()
        assert agent.proc.returncode == -signal.SIGKILL, agent.output()
        if kill_at == "approval" and n == len(kills) - 1:
            # A person approves while no agent process is running
            [pending] = client.get_agent_snapshot(session).pending_interrupts
            assert client.resolve_interrupt(session, pending.interrupt_id, True)
    raise AssertionError("unreachable")


def _await_its_end(agent: AgentProcess, kill_at: str, session: str, ledger_path: Path) -> None:
    """Wait for the process to end, or kill it at its point (while the tool runs, while the run
    waits for an approval)."""
    if kill_at == "tool":
        # While the tool runs: its ledger line is written when it starts
        wait_until(lambda: any(e["key"].startswith(f"{session}/") for e in
                               ledger.read(ledger_path)), 60, "the tool to start")
        assert agent.proc.poll() is None, agent.output()
        agent.kill()
    elif kill_at == "approval":
        wait_until(lambda: "paused" in agent.output() or agent.proc.poll() is not None,
                   60, "the run to pause on its approval")
        assert "paused" in agent.output(), agent.output()
        agent.kill()
    else:
        agent.proc.wait(60)


# Ten agent processes (each imports Pydantic AI), three chains at once: about 30 s on an idle
# two-core machine, several times that on a loaded one.
@pytest.mark.long  # make chaos; in make test: the killed-while-its-tool-runs story below
@pytest.mark.timeout(300)
def test_an_agent_killed_anywhere_runs_its_tool_once_and_asks_each_decision_once(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path, sweeping: list[int],
) -> None:
    # Given a worker (and the republisher, as beat runs it)
    start_worker(concurrency=4)
    # When each story's agent processes are killed at their points and started again
    with ThreadPoolExecutor(len(STORIES)) as pool:
        done = dict(zip(STORIES, pool.map(
            lambda name: _story(name, client, env, ledger_path, tmp_path), STORIES),
            strict=True))
    for name, (session, model_log, output) in done.items():
        _check_story(client, ledger_path, name, STORIES[name][2], session, model_log, output)


def test_an_agent_killed_while_its_tool_runs_runs_it_once(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path, sweeping: list[int],
) -> None:
    # Given a worker; when the agent process is killed while its charge runs, then started again
    start_worker(concurrency=2)
    session, model_log, output = _story("tool", client, env, ledger_path, tmp_path)
    # Then as in every story: one start, each decision made once, the turn over
    _check_story(client, ledger_path, "tool", ["tool"], session, model_log, output)


def _check_story(client: DexClient, ledger_path: Path, name: str, kills: list[str],
                 session: str, model_log: list[dict[str, Any]], output: str) -> None:
    starts = ledger.executions(ledger_path)
    # Then the tool started exactly once, under the key of the journaled decision
    [call] = client.get_agent_snapshot(session).tool_calls
    assert starts[call.key] == 1, name
    assert [k for k in starts if k.startswith(f"{session}/")] == [call.key]
    assert call.status is CallStatus.SUCCEEDED
    # And the model made each decision once; it was asked again only when killed before
    # it answered
    answered = [e["step"] for e in model_log if e["event"] == "answered"]
    asked = [e["step"] for e in model_log if e["event"] == "asked"]
    assert sorted(answered) == [0, 1], name
    assert sorted(asked) == [0] * (1 + kills.count("model")) + [1], name
    # And the answer read the one call's result; the turn is over
    assert json.loads(output)["output"].startswith("done: "), output
    assert client.open_turn(session) is None
    messages = client.get_agent_snapshot(session).messages
    assert [m.role for m in messages] == [MessageRole.USER, MessageRole.ASSISTANT,
                                          MessageRole.TOOL, MessageRole.ASSISTANT]


# -- in one process ----------------------------------------------------------------------------


def _scripted(steps: list[list[ToolCallPart]], asked: list[int]) -> FunctionModel:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        made = sum(isinstance(m, ModelResponse) for m in messages)
        asked.append(made)
        if made < len(steps):
            return ModelResponse(parts=list(steps[made]))
        return ModelResponse(parts=[TextPart(f"done after {made} steps")])

    return FunctionModel(model)


def test_a_turn_replays_from_the_store_and_a_new_input_waits_for_it(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
) -> None:
    start_worker(concurrency=2)
    asked: list[int] = []
    # A fake model that reuses its call id from one step to the next: distinct keys anyway
    agent = Agent(_scripted([[ToolCallPart("lookup_order", {"order_id": "1001"}, "c")],
                             [ToolCallPart("lookup_order", {"order_id": "1002"}, "c")]], asked),
                  output_type=[str, DeferredToolRequests])
    result = asyncio.run(agent.run("Where are my orders?",
                                   capabilities=[DexCapability(client, session_id="s-in")]))
    assert result.output == "done after 2 steps"
    keys = [c.key for c in client.get_agent_snapshot("s-in").tool_calls]
    assert len(set(keys)) == 2 and all("/0.c" in k or "/1.c" in k for k in keys)
    assert sorted(ledger.executions(ledger_path)) == sorted(keys)
    assert client.open_turn("s-in") is None

    # A turn left open (the process died after its first step): a new input is queued, not a
    # second turn, and the open turn's own input continues it from the store
    turn = client.begin_turn("s-open", "Where is order 1001?")
    step = ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "1001"}, "x")])
    client.record_step("s-open", turn.turn_id, 0,
                       ModelMessagesTypeAdapter.dump_json([step]).decode(),
                       [{"tool_call_id": "0.x", "tool": "lookup_order",
                         "arguments": {"order_id": "1001"}}])
    asked.clear()
    with pytest.raises(TurnInProgressError, match="queued"):
        asyncio.run(agent.run("Something else",
                              capabilities=[DexCapability(client, session_id="s-open")]))
    assert asked == []
    resumed = asyncio.run(agent.run("Where is order 1001?",
                                    capabilities=[DexCapability(client, session_id="s-open")]))
    assert asked == [1, 2]  # step 0 came from the store
    assert resumed.output == "done after 2 steps"
    messages = client.get_agent_snapshot("s-open").messages
    assert messages[-1].role is MessageRole.USER and messages[-1].text == "Something else"
    assert messages[-1].status == "delivered"
    assert ledger.executions(ledger_path)[f"s-open/{turn.turn_id}/0.x"] == 1
