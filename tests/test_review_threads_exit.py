"""Issue 19, finding 1: a tool calling ``sys.exit()`` on ``-P threads`` is a lost worker,
recorded at once, and its slot is freed.

Celery's threads pool hands the exit (as ``WorkerLostError``) to the request's success
callback, which drops it: the call stayed ``running`` for ever, its lease renewed, its slot
taken. No beat runs here, so nothing but the worker itself can end the call.
"""

from __future__ import annotations

from pathlib import Path

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient
from tests.conftest import StartWorker
from workers import ledger

TOOLS = "workers.example_tools,tests.edge_tools"


def test_sys_exit_in_a_pool_thread_ends_the_call_at_once_and_frees_its_slot(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a threads worker with one slot
    worker = start_worker(concurrency=1, pool="threads", tools=TOOLS)

    # When a charge's tool calls sys.exit() in its thread
    charge = client.call_tool(session_id="s", turn_id="t", tool_call_id="exit",
                              tool="base_charge", arguments={"kind": "system_exit"})
    # Then it ends outcome_unknown at once (no lease has to run out, no reaper runs here)
    final = client.wait(charge.key, timeout=15)
    assert final.status is CallStatus.OUTCOME_UNKNOWN, final
    assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "exited its worker thread" in (final.error or "")
    assert final.attempts == 1

    # And a read whose tool exits is a lost attempt each time: run again until its attempts
    # run out, then failed
    read = client.call_tool(session_id="s", turn_id="t", tool_call_id="exit-read",
                            tool="base_lookup", arguments={"kind": "system_exit"})
    ended = client.wait(read.key, timeout=30)
    assert ended.status is CallStatus.FAILED, ended
    assert ended.attempts == ended.max_attempts > 1

    # And the one slot serves the next call
    after = client.call_tool(session_id="s", turn_id="t", tool_call_id="after",
                             tool="whoami", arguments={})
    assert client.wait(after.key, timeout=15).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path)[charge.key] == 1
    assert ledger.executions(ledger_path)[read.key] == ended.max_attempts
    assert worker.proc.poll() is None
