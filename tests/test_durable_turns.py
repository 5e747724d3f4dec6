"""Durable turns (issue 18): a real agent process SIGKILLed at each point DESIGN.md lists,
restarted the plain way, five times in one turn, per framework:

* OpenAI Agents SDK (``tests/openai_durable_agent.py``): the same ``Runner.run`` with
  ``dex_run_config``, then the ``apply_dex_decisions`` loop;
* LangGraph (``tests/langgraph_durable_agent.py``): ``DexMiddleware`` and ``DexCheckpointer``
  with ``durability="sync"``, continued LangGraph's way on the same thread.

The model mints a new call id each time it is asked (as a real model does), so a model asked
again for a decision would start the non-idempotent charge a second time under a new key. The
ledger counts tool starts; the model's log counts its answers per decision.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dex_tasks import CallStatus, DexClient
from tests.conftest import StartWorker
from tests.helpers import ROOT, wait_until
from workers import ledger

SESSION = "s-durable"
AGENTS = {"openai": "tests.openai_durable_agent", "langgraph": "tests.langgraph_durable_agent"}


class Agent:
    """One agent process; its output goes to a file next to the model's log."""

    def __init__(self, env: dict[str, str], log: Path, kill_at: str = "") -> None:
        self.out = log.with_name(f"agent-{len(list(log.parent.glob('agent-*')))}.log")
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", env["DEX_TEST_AGENT"], SESSION, str(log), kill_at],
                cwd=ROOT, env={**env, "DEX_TEST_SLEEP": "3"}, stdout=out,
                stderr=subprocess.STDOUT)

    def killed(self) -> None:
        """The process died of SIGKILL (its own, or ours)."""
        code = self.proc.wait(90)
        assert code == -signal.SIGKILL, (code, self.out.read_text())

    def kill(self) -> None:
        self.proc.kill()
        self.killed()

    def finished(self) -> str:
        code = self.proc.wait(90)
        assert code == 0, self.out.read_text()
        return self.out.read_text()


def answers(log: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        n = json.loads(line)["decision"]
        counts[n] = counts.get(n, 0) + 1
    return counts


def tool_starts(ledger_path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in ledger.read(ledger_path):
        counts[entry["tool"]] = counts.get(entry["tool"], 0) + 1
    return counts


def killed_while_charging_then_at_the_refund(env: dict[str, str], log: Path, client: DexClient,
                                             ledger_path: Path) -> list[Any]:
    """Two agent processes: one killed while its charge runs on the worker, the next killed
    once its refund awaits a person; the pending interrupts."""
    agent = Agent(env, log)
    wait_until(lambda: tool_starts(ledger_path).get("charge_card") == 1, 60, "the charge")
    agent.kill()
    agent = Agent(env, log)
    pending: list[Any] = wait_until(
        lambda: client.get_agent_snapshot(SESSION).pending_interrupts, 60,
        "the refund to await approval")
    agent.kill()
    return pending


@pytest.mark.long  # make chaos; in make test: the short chain below
@pytest.mark.parametrize("framework", sorted(AGENTS))
@pytest.mark.timeout(300)  # six agent processes importing their framework: slow on a busy machine
def test_an_agent_killed_at_every_point_of_a_turn_starts_each_tool_once_and_asks_each_decision_once(
    framework: str, client: DexClient, start_worker: StartWorker, env: dict[str, str],
    ledger_path: Path, tmp_path: Path,
) -> None:
    start_worker(concurrency=2)
    env = {**env, "DEX_TEST_AGENT": AGENTS[framework]}
    log = tmp_path / "model.jsonl"

    # 1. Killed while the model is asked its first decision (before it answered).
    Agent(env, log, "model0").killed()
    assert answers(log) == {} and tool_starts(ledger_path) == {}

    # 2. Restart 1: the model answers (a charge), the step is journaled with its call, and the
    #    process dies before the call is sent.
    Agent(env, log, "dispatch").killed()
    assert answers(log) == {0: 1}
    (charge,) = client.get_agent_snapshot(SESSION).tool_calls
    assert charge.tool == "charge_card" and charge.status is CallStatus.QUEUED
    if framework == "openai":  # the model's answer is journaled in the session
        turn = client.open_turn(SESSION)
        assert turn is not None and [s.step for s in turn.steps] == [0]
        assert [c.key for c in turn.steps[0].calls] == [charge.key]
    assert tool_starts(ledger_path) == {}

    # 3. Restart 2: step 0 is replayed (same call id, same key): the call is sent once; killed
    #    while the charge runs on the worker.
    # 4. Restart 3: the charge is awaited, not started again; the model asks for a refund,
    #    which waits for a person; killed while it waits.
    pending = killed_while_charging_then_at_the_refund(env, log, client, ledger_path)
    assert client.get_tool_call(charge.key).status is CallStatus.SUCCEEDED
    assert answers(log) == {0: 1, 1: 1}
    assert client.resolve_interrupt(SESSION, pending[0].interrupt_id, approved=True)

    # 5. Restart 4: both steps replayed, the approval applied, the refund runs; killed when
    #    the model is asked its last decision (the refund ended, its result not yet read).
    Agent(env, log, "model2").killed()
    assert tool_starts(ledger_path) == {"charge_card": 1, "refund_payment": 1}

    # 6. Restart 5: the turn completes.
    out = Agent(env, log).finished()
    assert json.loads(out.strip().splitlines()[-1]) == {"final": "Charged and refunded."}
    # Each tool started exactly once; the model answered each decision exactly once.
    assert tool_starts(ledger_path) == {"charge_card": 1, "refund_payment": 1}
    assert answers(log) == {0: 1, 1: 1, 2: 1}
    snapshot = client.get_agent_snapshot(SESSION)
    assert [c.status for c in snapshot.tool_calls] == [CallStatus.SUCCEEDED] * 2
    if framework == "openai":  # the turn ended with the model's answer
        assert client.open_turn(SESSION) is None
        assert snapshot.messages[-1].text == "Charged and refunded."


@pytest.mark.parametrize("framework", sorted(AGENTS))
@pytest.mark.timeout(240)
def test_an_agent_killed_while_its_charge_runs_never_starts_it_again(
    framework: str, client: DexClient, start_worker: StartWorker, env: dict[str, str],
    ledger_path: Path, tmp_path: Path,
) -> None:
    # make test's part of the chain above: points 3 and 4 only
    start_worker(concurrency=2)
    env = {**env, "DEX_TEST_AGENT": AGENTS[framework]}
    log = tmp_path / "model.jsonl"
    # Given an agent killed while its charge runs on the worker; when it is started again, the
    # plain way, and reaches its refund (which awaits a person)
    killed_while_charging_then_at_the_refund(env, log, client, ledger_path)
    # Then the charge was awaited, not started again, and the model decided each step once
    (charge, refund) = client.get_agent_snapshot(SESSION).tool_calls
    assert client.get_tool_call(charge.key).status is CallStatus.SUCCEEDED
    assert refund.status is CallStatus.AWAITING_APPROVAL
    assert tool_starts(ledger_path) == {"charge_card": 1}
    assert answers(log) == {0: 1, 1: 1}
