"""The CrewAI adapter (issue 22): ``dex_crew_tools``.

The model is an offline ``BaseLLM`` subclass in CrewAI's ReAct format
(``examples/crewai_agent.py``'s ``ScriptedLLM``); Redis, the store and the workers are real.
What the tests show, the four behaviours every adapter is tested for:

* a read runs on a worker and its result reaches the model;
* a refund that needs approval is a tool result telling the agent it awaits a person; the
  crew's process exits; a person approves in dex-tasks; the same crew run in a new process
  gets the recorded lookup and the refund runs once;
* a rejection reaches the model with the person's message;
* a crew re-run, and CrewAI's own retry of a tool that raised, never start a tool twice.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from crewai import Agent, Crew, Task

from dex_tasks import CallStatus, DexClient
from dex_tasks.integrations.crewai import dex_ids
from tests.conftest import StartWorker
from tests.helpers import ROOT, load_module, wait_until
from workers import ledger

EXAMPLE = ROOT / "examples" / "crewai_agent.py"


def load_example() -> ModuleType:
    module: ModuleType = load_module(EXAMPLE, "crewai_agent")
    return module


def test_an_approval_survives_the_crew_process_and_the_refund_runs_once(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_worker(concurrency=2)

    # Given a crew process that reads an order (the read runs, the model reads its total)
    # and asks for a refund: the agent is told the refund awaits a person; the process exits
    first = subprocess.run([sys.executable, str(EXAMPLE), "--session", "ca"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=90)
    assert first.returncode == 3, first.stdout + first.stderr
    assert "waiting for a person: refund_payment" in first.stdout
    (lookup_key,) = ledger.executions(ledger_path)
    assert lookup_key.endswith(".0.lookup_order")
    (pending,) = client.get_agent_snapshot("ca").pending_interrupts
    assert (pending.tool, pending.arguments) == (
        "refund_payment", {"charge_id": "ch_1001", "amount_cents": 4599})

    # When a person approves and the same crew runs again (in this process): the lookup gives
    # its recorded result, the refund runs, and the model reads its result
    assert client.resolve_interrupt("ca", pending.interrupt_id, True, approver="alice")
    example = load_example()
    capsys.readouterr()
    crew = example.build_crew(client, "ca", "1001")
    assert example.run_crew(client, crew, "ca") == 0
    assert 'refund tool said: {"charge_id": "ch_1001", "refunded_cents": 4599}' in (
        capsys.readouterr().out)
    # (the model's two journaled decisions were replayed: it was asked for the answer only)
    assert crew.agents[0].llm._inner.asked == 1
    step = crew_step(example, client, "ca", "1001", 1, "refund_payment")
    refund_key = "/".join(dex_ids("ca", *step))
    assert ledger.executions(ledger_path) == {lookup_key: 1, refund_key: 1}
    assert client.get_tool_call(refund_key).status is CallStatus.SUCCEEDED

    # And running it once more starts nothing again, nor asks the model: the task's turn ended
    crew = example.build_crew(client, "ca", "1001")
    assert example.run_crew(client, crew, "ca") == 0
    assert 'refund tool said: {"charge_id": "ch_1001"' in capsys.readouterr().out
    assert crew.agents[0].llm._inner.asked == 0
    assert ledger.executions(ledger_path) == {lookup_key: 1, refund_key: 1}


def crew_step(example: ModuleType, client: DexClient, session_id: str, order_id: str,
              iteration: int, tool: str) -> tuple[Any, Any, Any, int, str]:
    """The task, agent and crew of the example's crew, with a step: what a key is built
    from."""
    crew = example.build_crew(client, session_id, order_id)
    return crew.tasks[0], crew.agents[0], crew, iteration, tool


def test_a_rejection_reaches_the_model(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    start_worker(concurrency=2)
    example = load_example()
    assert example.run(client, "cb", "1002") == 3
    (pending,) = client.get_agent_snapshot("cb").pending_interrupts
    assert client.resolve_interrupt("cb", pending.interrupt_id, False,
                                    rejection_message="no refunds before shipping")
    capsys.readouterr()
    assert example.run(client, "cb", "1002") == 0
    out = capsys.readouterr().out
    assert "refund tool said: Error:" in out and "no refunds before shipping" in out
    assert [k.rsplit(".", 1)[1] for k in ledger.executions(ledger_path)] == ["lookup_order"]


def test_keys_are_injective_in_the_crew_ids() -> None:
    agent = Agent(role="r", goal="g", backstory="b", llm=load_example().ScriptedLLM())
    tasks = [Task(description="d", expected_output="e", agent=agent) for _ in range(2)]
    crew = Crew(agents=[agent], tasks=tasks)
    keys = {"/".join(dex_ids(session, task, agent, crew, step, tool))
            for session in ("a/b", "a~2fb", "a") for task in tasks for step in (0, 1)
            for tool in ("t", "t.0")}
    assert len(keys) == 3 * 2 * 2 * 2 and all(key.count("/") == 2 for key in keys)


@pytest.mark.long
def test_a_crew_killed_while_its_tool_runs_is_run_again_without_running_it_again(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path,
) -> None:
    start_worker(concurrency=2)
    command = [sys.executable, "-m", "tests.crewai_agent_proc", "ck"]

    # Given a crew whose agent charges a card (a slow single-attempt write)
    with open(tmp_path / "crew.log", "wb") as log:
        crew = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        # When the crew's process is SIGKILLed while the charge runs on the worker
        wait_until(lambda: bool(ledger.executions(ledger_path)), 60, "the charge to start")
        crew.kill()
    finally:
        crew.wait(10)
    (key,) = ledger.executions(ledger_path)

    # Then the same crew run again (whose model would now charge 700 if it were asked)
    # replays the journaled decision and reaches the same call: the model reads the charge of
    # 500, and the card was charged once
    again = subprocess.run(command, cwd=ROOT, env={**env, "CHARGE_CENTS": "700"},
                           capture_output=True, text=True, timeout=90)
    assert again.returncode == 0, again.stdout + again.stderr
    assert 'charge said: {"charge_id": "ch_' in again.stdout, again.stdout
    assert '"charged_cents": 500' in again.stdout
    assert ledger.executions(ledger_path) == {key: 1}
    assert client.get_tool_call(key).status is CallStatus.SUCCEEDED


def test_crewais_own_retry_of_a_tool_that_raised_never_charges_twice(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # crewAI #5802: CrewAI calls a tool again when it raised, and the payment ran twice
    start_worker(concurrency=2)
    monkeypatch.setenv("DEX_EXAMPLE_LEDGER", str(ledger_path))
    proc = load_module(ROOT / "tests" / "crewai_agent_proc.py", "crewai_agent_proc")
    made: list[str] = []
    call_tool = client.call_tool

    def lost_answer(**request: Any) -> Any:
        record = call_tool(**request)  # the call is recorded and sent...
        made.append(record.key)
        if len(made) == 1:
            raise ConnectionError("the store's answer was lost")  # ...but the tool raises
        return record

    monkeypatch.setattr(client, "call_tool", lost_answer)
    crew = proc.crew(client, "cr")
    assert 'charge said: {"charge_id": "ch_' in str(crew.kickoff())
    assert len(made) == 2 and made[0] == made[1]  # CrewAI's retry: the same key
    assert ledger.executions(ledger_path) == {made[0]: 1}

    # A dex tool run outside a crew's task has no key: it does not run
    (charge,) = crew.agents[0].tools
    assert "runs only inside a crew's task" in charge.run(customer_id="cu_1", amount_cents=1)
    assert len(made) == 2


def test_the_example_never_stops_on_crewais_trace_prompt(
    start_worker: StartWorker, env: dict[str, str], tmp_path: Path,
) -> None:
    # issue 31: after a crew's first run on a machine CrewAI asks on the console whether to
    # view its execution traces and waits 20 s for an answer, which an agent process (a
    # server, a script run again after an approval) has nobody to give
    start_worker(concurrency=2)
    # Given a machine where CrewAI has never run (its user data in a folder of its own), and
    # an input that stays open and says nothing, as a service's stdin does
    fresh = {**env, "XDG_DATA_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--session", "quiet"], cwd=ROOT,
                            env=fresh, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)  # (communicate closes stdin only at the end)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - started
    # Then the crew ran to its end (the refund waits for a person) without asking anything
    assert proc.returncode == 3, out
    assert "waiting for a person: refund_payment" in out
    assert "execution traces" not in out, out
    assert "[y/N]" not in out
    print(f"\nthe example's first run on a fresh machine: {elapsed:.1f} s")
