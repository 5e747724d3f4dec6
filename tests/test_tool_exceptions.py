"""Tools that fail at the edges, on a real worker: ``retry_after`` hints that are infinite, not
a number, absurdly large or negative, and exceptions that are not ``Exception``s.

No beat runs in these tests: a call that only the lease reaper could finish would never end, so
``client.wait`` proves that the worker recorded each outcome itself, at once.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from dex_tasks import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, DexClient, EffectClass
from dex_tasks.worker.retry import after_transient_error
from tests.conftest import StartWorker
from workers import ledger

TOOLS = "workers.example_tools,tests.edge_tools"
HINTS = ["inf", "nan", "1e300", "-5", "1e-3"]


@pytest.mark.parametrize("hint", [math.inf, math.nan, 1e300, -5.0, -math.inf, 7.0, 0.0])
def test_retry_after_is_bounded_by_the_backoff_cap(hint: float) -> None:
    decision = after_transient_error(EffectClass.READ, 1, 3, "x", base=1.0, cap=2.0,
                                     retry_after=hint)
    assert decision.retry
    assert 0.0 <= decision.delay <= 2.0
    if math.isnan(hint):
        # No usable hint: the computed backoff (half fixed, half jitter) applies.
        assert 0.5 <= decision.delay <= 1.0
    elif hint <= 0:
        assert decision.delay == 0.0
    else:
        assert decision.delay == min(hint, 2.0)


def test_odd_retry_after_hints_are_retried_within_the_cap(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given reads whose first attempt asks to be retried after inf, nan, 1e300, -5 and 1 ms
    start_worker(concurrency=2, tools=TOOLS)
    records = {hint: client.call_tool(session_id="s-hint", turn_id="t1", tool_call_id=f"h{i}",
                                      tool="hinted_lookup", arguments={"retry_after": hint})
               for i, hint in enumerate(HINTS)}

    # Then each is retried once and succeeds; none is left queued for ever
    cap = client.settings.retry_backoff_max_seconds
    for hint, record in records.items():
        final = client.wait(record.key, timeout=30)
        assert final.status is CallStatus.SUCCEEDED, (hint, final.error)
        assert final.attempts == 2
        runs = sorted((e for e in ledger.read(ledger_path) if e["key"] == record.key),
                      key=lambda e: e["attempt"])
        assert [e["attempt"] for e in runs] == [1, 2]
        # And the retry was due within the cap: the gap is the countdown plus delivery time,
        # which on a loaded machine is well under two seconds
        for before, after in itertools.pairwise(runs):
            assert after["at"] - before["at"] < cap + 2.0, hint


@pytest.mark.parametrize("kind", ["keyboard_interrupt", "custom"])
def test_a_base_exception_from_a_tool_is_its_error_at_once(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, kind: str
) -> None:
    # Given a worker with one child, a charge and a read whose tools raise a BaseException
    # that is not an Exception (KeyboardInterrupt, or a library's own)
    start_worker(concurrency=1, tools=TOOLS)
    charge = client.call_tool(session_id="s-base", turn_id="t1", tool_call_id="charge",
                              tool="base_charge", arguments={"kind": kind})
    read = client.call_tool(session_id="s-base", turn_id="t1", tool_call_id="read",
                            tool="base_lookup", arguments={"kind": kind})
    name = "KeyboardInterrupt" if kind == "keyboard_interrupt" else "Abort"

    # Then each call ends failed with the exception as the tool's error, without waiting for
    # a lease (no beat runs here), and neither runs again: it is not a transient error
    for record, what in ((charge, "charge"), (read, "lookup")):
        final = client.wait(record.key, timeout=20)
        assert final.status is CallStatus.FAILED
        assert final.error == f"{name}: {what} stopped by {kind}"
        assert final.attempts == 1
    assert ledger.executions(ledger_path)[charge.key] == 1
    assert ledger.executions(ledger_path)[read.key] == 1

    # And the child that ran them is still the one serving calls
    pids = {e["pid"] for e in ledger.read(ledger_path)}
    after = client.call_tool(session_id="s-base", turn_id="t1", tool_call_id="after",
                             tool="whoami", arguments={})
    done = client.wait(after.key, timeout=20)
    assert done.status is CallStatus.SUCCEEDED
    assert done.result["pid"] in pids


def test_celery_and_system_exceptions_from_a_tool_keep_their_meaning(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    worker = start_worker(concurrency=1, tools=TOOLS)
    # Given a read whose tool raises Celery's WorkerLostError, and one raising Celery's Ignore:
    # the tool's own errors, so each ends failed and is neither requeued nor ignored
    for kind, name in (("worker_lost", "WorkerLostError"), ("ignore", "Ignore")):
        record = client.call_tool(session_id="s-exit", turn_id="t1", tool_call_id=kind,
                                  tool="base_lookup", arguments={"kind": kind})
        final = client.wait(record.key, timeout=20)
        assert final.status is CallStatus.FAILED
        assert final.error == f"{name}: lookup stopped by {kind}"
        assert final.attempts == 1
        assert ledger.executions(ledger_path)[record.key] == 1

    # When a charge's tool calls sys.exit(): the process running it exits, as it asked
    charge = client.call_tool(session_id="s-exit", turn_id="t1", tool_call_id="exit",
                              tool="base_charge", arguments={"kind": "system_exit"})
    # Then that is a lost worker: the charge ends outcome_unknown at once (the main process
    # records it; no lease has to run out) and never runs again
    final = client.wait(charge.key, timeout=20)
    assert final.status is CallStatus.OUTCOME_UNKNOWN
    assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert final.attempts == 1
    # And a replacement child serves the next call
    after = client.call_tool(session_id="s-exit", turn_id="t1", tool_call_id="after",
                             tool="whoami", arguments={})
    assert client.wait(after.key, timeout=20).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path)[charge.key] == 1
    assert worker.proc.poll() is None
