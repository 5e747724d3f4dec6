"""``dex-tasks mcp`` end to end with a framework's own MCP client (issue 22): the OpenAI Agents
SDK's ``MCPServerStdio`` (``mcp_servers=``), its ``ScriptedModel`` offline, real workers. The
agent is ``examples/mcp_server_agent.py``; it sends the run context's turn and the model's
call id as each request's ``_meta``. What the test shows, the four behaviours every adapter is
tested for:

* a read's result reaches the model;
* a refund that needs approval is answered "awaits approval"; the agent process exits; a
  person approves; the agent run again (a new ``dex-tasks mcp`` too) gets the refund's result,
  and the refund ran once;
* re-running the run (the read again, with the same ids) starts no tool a second time;
* a rejection reaches the model, with the person's message.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dex_tasks import CallStatus, DexClient
from tests.conftest import StartWorker
from tests.helpers import ROOT, load_module
from workers import ledger

EXAMPLE = ROOT / "examples" / "mcp_server_agent.py"


def load_example() -> ModuleType:
    module: ModuleType = load_module(EXAMPLE, "mcp_server_agent")
    return module


def test_an_agent_through_dex_tasks_mcp_reads_waits_survives_its_process_and_runs_once(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    start_worker(concurrency=2)

    # Given an agent process that reads an order and asks for a refund: the read runs, the
    # refund waits for a person, dex-tasks mcp answers that it awaits approval; the process
    # exits
    first = subprocess.run(
        [sys.executable, str(EXAMPLE), "--session", "sa", "--approval-timeout", "0.5"],
        cwd=ROOT, env={**env, "OPENAI_AGENTS_DISABLE_TRACING": "1"}, capture_output=True,
        text=True, timeout=90,
    )
    assert first.returncode == 3, first.stdout + first.stderr
    assert "DEX_AWAITING_APPROVAL" in first.stdout and "sa/turn-1/call_refund" in first.stdout
    assert ledger.executions(ledger_path) == {"sa/turn-1/call_lookup": 1}
    (pending,) = client.get_agent_snapshot("sa").pending_interrupts
    assert (pending.tool, pending.arguments) == (
        "refund_payment", {"charge_id": "ch_1001", "amount_cents": 4599})

    # When a person approves and the agent runs again (here in this process, with a new
    # dex-tasks mcp): the model asks for the lookup and the refund again, with the same ids,
    # then it reads the refund's result; the lookup did not run again, the refund ran once
    assert client.resolve_interrupt("sa", pending.interrupt_id, True, approver="alice")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    example = load_example()
    example.set_tracing_disabled(True)
    asyncio.run(in_process(example, client, capfd))
    assert ledger.executions(ledger_path) == {
        "sa/turn-1/call_lookup": 1, "sa/turn-1/call_refund": 1, "sb/turn-1/call_lookup": 1}
    assert client.get_tool_call("sb/turn-1/call_refund").status is CallStatus.REJECTED


async def in_process(example: ModuleType, client: DexClient,
                     capfd: pytest.CaptureFixture[str]) -> None:
    """The approved session run again, then a rejected one, over one new dex-tasks mcp."""
    async with example.dex_mcp_server(0.5) as server:
        assert await example.run(server, "sa", "1001") == 0
        assert 'refund tool said: {"charge_id": "ch_1001", "refunded_cents": 4599}' in (
            capfd.readouterr().out)

        # A rejection reaches the model with the person's message
        refund = client.call_tool(session_id="sb", turn_id="turn-1",
                                  tool_call_id="call_refund", tool="refund_payment",
                                  arguments={"charge_id": "ch_1001", "amount_cents": 4599})
        assert refund.interrupt_id is not None
        assert client.resolve_interrupt("sb", refund.interrupt_id, False,
                                        rejection_message="no refunds on shipped orders")
        assert await example.run(server, "sb", "1001") == 0
        out = capfd.readouterr().out
        assert "refund tool said:" in out and "no refunds on shipped orders" in out
