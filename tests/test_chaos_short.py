"""The chaos harness: a short real run (part of ``make test``), and its checks on made-up runs.

The real run is a few hundred mixed calls over 20 s against two workers and beat, with busy
children and a whole worker SIGKILLed, beat restarted and Redis crashed and restarted. The
long run is ``make chaos``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chaos.checks import APPROVE, EXPIRE, Kill, ToolMessage, check_run
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT, TOOL_DID_NOT_RUN
from dex_tasks.store.deadlines import deadline_error
from dex_tasks.store.models import ToolCallRow
from tests.helpers import ROOT


def test_short_chaos_run_keeps_every_guarantee(tmp_path: Path) -> None:
    summary = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "chaos", "--calls", "300", "--workers", "2", "--duration", "20",
         "--child-kills", "6", "--worker-kills", "1", "--beat-restarts", "1",
         "--redis-restarts", "1", "--settle-timeout", "45", "--seed", "7",
         "--workdir", str(tmp_path / "run"), "--json", str(summary), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )
    output = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    result = json.loads(summary.read_text())
    figures = result["figures"]
    assert result["ok"] and result["violations"] == []
    assert figures["calls"] == 300 and figures["status.succeeded"] > 200
    # The faults really happened (a child kill is skipped only if no child was in a tool).
    assert figures["kills.child"] >= 4, output
    assert figures["kills.worker"] == 1 and figures["faults.redis"] == 1
    assert figures["faults.beat"] == 1 and figures["faults.store"] == 1
    assert figures.get("duplicates.single_attempt", 0) == 0
    # Every call ended, and each has exactly one tool message in its session's transcript
    # (a missing, doubled or mislabelled one would be a violation above)
    assert figures["tool_messages"] == figures["calls"]


# -- the checks, on fabricated runs -------------------------------------------------------------


def _call(key: str, tool: str, effect: str, status: str, *, attempts: int = 1,
          max_attempts: int = 1, error: str | None = None) -> ToolCallRow:
    return ToolCallRow(key=key, session_id="s", turn_id="t", tool_call_id=key, tool=tool,
                       arguments="{}", effect=effect, requires_approval=False,
                       max_attempts=max_attempts, status=status, attempts=attempts,
                       error=error, created_at=1.0, updated_at=2.0, finished_at=2.0)


def _ran(key: str, attempt: int = 1, pid: int = 100, at: float = 5.0) -> dict[str, Any]:
    return {"tool": "t", "key": key, "attempt": attempt, "pid": pid, "at": at}


UNKNOWN = f"{OUTCOME_UNKNOWN_TOOL_RESULT}: the worker process running the tool was lost"
DID_NOT_RUN = f"{TOOL_DID_NOT_RUN}: the broker could not be reached"
KILL = Kill(at=6.0, kind="child", pids=(100,))

CASES: dict[str, tuple[ToolCallRow, list[dict[str, Any]], dict[str, str], str]] = {
    "a charge executed twice": (
        _call("k", "charge_card", "non_idempotent_write", "succeeded"),
        [_ran("k", pid=100), _ran("k", pid=101)], {}, "executed_twice"),
    "outcome_unknown with no kill after its start": (
        _call("k", "charge_card", "non_idempotent_write", "outcome_unknown", error=UNKNOWN),
        [_ran("k", at=7.0)], {}, "unknown_without_kill"),
    "outcome_unknown that never reached the tool": (
        _call("k", "charge_card", "non_idempotent_write", "outcome_unknown", error=UNKNOWN),
        [], {}, "unknown_without_execution"),
    "a read ending outcome_unknown": (
        _call("k", "lookup_order", "read", "outcome_unknown", attempts=3, max_attempts=3,
              error=UNKNOWN),
        [_ran("k", attempt=3)], {}, "unknown_not_allowed"),
    "an idempotent write given up with attempts left": (
        _call("k", "update_address", "idempotent_write", "outcome_unknown", attempts=1,
              max_attempts=3, error=UNKNOWN),
        [_ran("k")], {}, "unknown_not_allowed"),
    "did-not-run without the exact prefix": (
        _call("k", "lookup_order", "read", "failed", attempts=0, max_attempts=3,
              error="The tool did not run: broker down"),
        [], {}, "did_not_run_prefix"),
    "did-not-run although the tool started": (
        _call("k", "charge_card", "non_idempotent_write", "failed", attempts=0,
              error=DID_NOT_RUN),
        [_ran("k")], {}, "did_not_run_but_ran"),
    "a read failing with attempts left": (
        _call("k", "lookup_order", "read", "failed", attempts=1, max_attempts=3,
              error="LookupError: no order"),
        [_ran("k")], {}, "unexpected_failure"),
    "a call left running": (
        _call("k", "lookup_order", "read", "running", max_attempts=3),
        [_ran("k")], {}, "not_terminal"),
    "an attempt run twice": (
        _call("k", "lookup_order", "read", "succeeded", attempts=2, max_attempts=3),
        [_ran("k", attempt=1), _ran("k", attempt=1, pid=101)], {}, "attempt_run_twice"),
    "an expiring approval that ran": (
        _call("k", "refund_payment", "non_idempotent_write", "succeeded"),
        [_ran("k")], {"k": EXPIRE}, "deadline_missed"),
    "an approved call rejected": (
        _call("k", "refund_payment", "non_idempotent_write", "rejected",
              error=deadline_error(3.0)),
        [], {"k": APPROVE}, "approval_lost"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_checks_report_each_broken_guarantee(case: str) -> None:
    call, ledger, intents, expected = CASES[case]
    verdict = check_run([call], ledger, [KILL], intents)
    kinds = [v.split(":", 1)[0] for v in verdict.violations]
    assert expected in kinds, verdict.violations


def test_checks_report_a_live_attempt_that_was_reaped() -> None:
    # The system declared attempt 1 lost (its lease ran out), but nothing killed pid 200.
    call = _call("k", "lookup_order", "read", "succeeded", attempts=2, max_attempts=3)
    ledger = [_ran("k", attempt=1, pid=200), _ran("k", attempt=2, pid=201)]
    verdict = check_run([call], ledger, [KILL], {}, lost=[("k", 1)])
    assert [v.split(":", 1)[0] for v in verdict.violations] == ["lost_while_alive"]


def test_checks_accept_a_run_where_every_guarantee_held() -> None:
    calls = [
        _call("a", "charge_card", "non_idempotent_write", "succeeded"),
        _call("b", "charge_card", "non_idempotent_write", "outcome_unknown", error=UNKNOWN),
        _call("c", "lookup_order", "read", "succeeded", attempts=2, max_attempts=3),
        _call("d", "flaky_read", "read", "failed", attempts=4, max_attempts=4,
              error="the tool failed on all 4 attempts; last error: busy"),
        _call("e", "update_address", "idempotent_write", "outcome_unknown", attempts=3,
              max_attempts=3, error=UNKNOWN),
        _call("f", "charge_card", "non_idempotent_write", "failed", attempts=0,
              error=DID_NOT_RUN),
        _call("g", "refund_payment", "non_idempotent_write", "rejected",
              error=deadline_error(3.0)),
        _call("h", "refund_payment", "non_idempotent_write", "succeeded"),
    ]
    ledger = [_ran("a", pid=7), _ran("b", pid=100), _ran("c", attempt=1, pid=100, at=5.5),
              _ran("c", attempt=2, pid=8), _ran("d", attempt=1), _ran("d", attempt=2),
              _ran("d", attempt=3), _ran("d", attempt=4), _ran("e", attempt=3, pid=100),
              _ran("h", pid=9)]
    verdict = check_run(calls, ledger, [KILL], {"g": EXPIRE, "h": APPROVE},
                        lost=[("b", 1), ("c", 1), ("e", 3)],
                        tool_messages=[ToolMessage(c.key, c.status) for c in calls])
    assert verdict.ok, verdict.violations
    assert verdict.figures["outcome_unknown"] == 2 and verdict.figures["did_not_run"] == 1


def test_checks_report_tool_messages_missing_doubled_early_wrong_or_orphaned() -> None:
    calls = [
        _call("missing", "lookup_order", "read", "succeeded", max_attempts=3),
        _call("doubled", "lookup_order", "read", "succeeded", max_attempts=3),
        _call("early", "lookup_order", "read", "running", max_attempts=3),
        _call("wrong", "lookup_order", "read", "succeeded", max_attempts=3),
        _call("fine", "lookup_order", "read", "succeeded", max_attempts=3),
    ]
    ledger = [_ran(c.key) for c in calls]
    messages = [ToolMessage("doubled", "succeeded"), ToolMessage("doubled", "succeeded"),
                ToolMessage("early", "succeeded"), ToolMessage("wrong", "failed"),
                ToolMessage("fine", "succeeded"), ToolMessage("nobody", "failed")]
    verdict = check_run(calls, ledger, [KILL], {}, tool_messages=messages)
    found = {(v.split(":", 1)[0], v.split(": ", 2)[1].split(" ")[0]) for v in verdict.violations}
    assert found == {("tool_message_count", "missing"), ("tool_message_count", "doubled"),
                     ("tool_message_too_early", "early"), ("tool_message_status", "wrong"),
                     ("not_terminal", "early"), ("tool_message_orphan", "nobody")}
    assert verdict.figures["tool_messages"] == 6
