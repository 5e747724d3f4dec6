"""The verdict of a chaos run: pure functions of the store's calls, the ledger and the kills.

No I/O here (``Tally`` only collects what the running harness reports), so the tests can feed
fabricated runs (a charge executed twice, an ``outcome_unknown`` no kill explains) and see each
one reported.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dex_tasks.policy import EffectClass
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT, TERMINAL, TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store.deadlines import APPROVAL_DEADLINE_PASSED
from dex_tasks.store.models import ToolCallRow

APPROVE = "approve"
EXPIRE = "expire"
# A kill at most this long before the ledger line still counts: both clocks are this machine's,
# but the ledger time is taken just before the line is written.
CLOCK_SLACK = 0.001


@dataclass(frozen=True)
class Kill:
    """One SIGKILL the harness sent: when, what kind, and every PID it hit."""

    at: float
    kind: str  # "child" or "worker"
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Execution:
    """One ledger line that marks a tool starting (tools with phases log more lines)."""

    key: str
    attempt: int
    pid: int
    at: float


@dataclass
class Verdict:
    """What the run showed: violations (empty when every guarantee held) and figures."""

    violations: list[str] = field(default_factory=list)
    by_tool: dict[str, Counter[str]] = field(default_factory=dict)
    figures: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


class Tally:
    """Figures and problems that the harness's threads report as they go (thread-safe)."""

    def __init__(self) -> None:
        self.figures: Counter[str] = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def count(self, figure: str, n: int = 1) -> None:
        with self.lock:
            self.figures[figure] += n

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def executions(ledger: Iterable[Mapping[str, Any]]) -> dict[str, list[Execution]]:
    """The ledger's executions grouped by idempotency key."""
    result: dict[str, list[Execution]] = defaultdict(list)
    for line in ledger:
        if line.get("phase") not in (None, "start"):
            continue
        result[line["key"]].append(
            Execution(line["key"], int(line["attempt"]), int(line["pid"]), float(line["at"]))
        )
    return result


def _single_attempt(call: ToolCallRow) -> bool:
    return not EffectClass(call.effect).retrying


@dataclass(frozen=True)
class ToolMessage:
    """One tool message of a transcript: the call it belongs to and the status it recorded."""

    key: str
    call_status: str


class _Checker:
    def __init__(self, calls: Sequence[ToolCallRow], runs: Mapping[str, list[Execution]],
                 kills: Sequence[Kill], intents: Mapping[str, str],
                 lost: Sequence[tuple[str, int]],
                 tool_messages: Sequence[ToolMessage] | None) -> None:
        self.calls = calls
        self.runs = runs
        self.kills = kills
        self.intents = intents
        self.lost = lost
        self.tool_messages = tool_messages
        self.verdict = Verdict()
        self.figures: Counter[str] = Counter()

    def problem(self, kind: str, call: ToolCallRow, text: str) -> None:
        self.figures[f"violations.{kind}"] += 1
        self.verdict.violations.append(f"{kind}: {call.key} ({call.tool}, {call.status}): {text}")

    def run(self) -> Verdict:
        by_key = {call.key: call for call in self.calls}
        for call in self.calls:
            self.verdict.by_tool.setdefault(call.tool, Counter())[call.status] += 1
            self.figures[f"status.{call.status}"] += 1
            self.check_executions(call)
            self.check_status(call)
        for key, attempt in self.lost:
            self.check_lost(by_key[key], attempt)
        if self.tool_messages is not None:
            self.check_transcript(by_key, self.tool_messages)
        self.figures["calls"] = len(self.calls)
        self.figures["executions"] = sum(len(v) for v in self.runs.values())
        self.figures["kills.child"] = sum(k.kind == "child" for k in self.kills)
        self.figures["kills.worker"] = sum(k.kind == "worker" for k in self.kills)
        self.figures["kills.worker_processes"] = sum(len(k.pids) for k in self.kills
                                                     if k.kind == "worker")
        self.verdict.figures = dict(self.figures)
        return self.verdict

    def check_executions(self, call: ToolCallRow) -> None:
        runs = self.runs.get(call.key, [])
        if len(runs) > 1:
            self.figures["executions.repeated"] += len(runs) - 1
        if _single_attempt(call):
            if len(runs) > 1:
                self.figures["duplicates.single_attempt"] += 1
                self.problem("executed_twice", call,
                             f"a single-attempt call ran {len(runs)} times "
                             f"(pids {[r.pid for r in runs]})")
            return
        attempts = Counter(r.attempt for r in runs)
        repeated = sorted(a for a, n in attempts.items() if n > 1)
        if repeated:
            self.problem("attempt_run_twice", call, f"attempt(s) {repeated} ran more than once")
        if len(runs) > call.attempts:
            self.problem("unclaimed_execution", call,
                         f"ran {len(runs)} times but claimed only {call.attempts} attempts")

    def check_status(self, call: ToolCallRow) -> None:
        status = CallStatus(call.status)
        error = call.error or ""
        intent = self.intents.get(call.key)
        if status not in TERMINAL:
            self.problem("not_terminal", call, "still not finished when the run ended")
            return
        if intent == EXPIRE and status is not CallStatus.REJECTED:
            self.problem("deadline_missed", call, "left to expire, but was not rejected")
        if intent == APPROVE and status is CallStatus.REJECTED:
            self.problem("approval_lost", call, f"approved, yet rejected: {error[:120]}")
        if status is CallStatus.SUCCEEDED:
            if not self.runs.get(call.key):
                self.problem("success_without_execution", call, "no ledger line")
        elif status is CallStatus.FAILED:
            self.check_failed(call, error)
        elif status is CallStatus.OUTCOME_UNKNOWN:
            self.check_unknown(call, error)
        elif status is CallStatus.REJECTED:
            if intent != EXPIRE:
                self.problem("unexpected_rejection", call, error[:120])
            elif not error.startswith(APPROVAL_DEADLINE_PASSED):
                self.problem("rejection_reason", call, f"deadline not named: {error[:120]}")
            if self.runs.get(call.key):
                self.problem("rejected_but_ran", call, "a rejected call has a ledger line")

    def check_failed(self, call: ToolCallRow, error: str) -> None:
        if error.startswith(TOOL_DID_NOT_RUN):
            self.figures["did_not_run"] += 1
            if self.runs.get(call.key):
                self.problem("did_not_run_but_ran", call, "failed as 'did not run' yet the "
                             "ledger shows the tool started")
            return
        if "did not run" in error:
            self.problem("did_not_run_prefix", call, f"no exact prefix: {error[:120]}")
            return
        if not _single_attempt(call) and call.attempts >= call.max_attempts:
            self.figures["attempts_ran_out"] += 1
            return
        self.problem("unexpected_failure", call, error[:160])

    def check_unknown(self, call: ToolCallRow, error: str) -> None:
        self.figures["outcome_unknown"] += 1
        if not error.startswith(OUTCOME_UNKNOWN_TOOL_RESULT):
            self.problem("unknown_prefix", call, f"no exact prefix: {error[:120]}")
        exhausted_write = (EffectClass(call.effect) is EffectClass.IDEMPOTENT_WRITE
                           and call.attempts >= call.max_attempts)
        if not (_single_attempt(call) or exhausted_write):
            self.problem("unknown_not_allowed", call,
                         "only single-attempt calls and idempotent writes out of attempts may "
                         "end outcome_unknown")
            return
        last = [r for r in self.runs.get(call.key, []) if r.attempt == call.attempts]
        if not last:
            self.problem("unknown_without_execution", call,
                         f"no ledger line for attempt {call.attempts}: no kill could have hit it")
            return
        if not self.killed(last[-1]):
            self.problem("unknown_without_kill", call,
                         f"pid {last[-1].pid} started it at {last[-1].at:.3f} and no kill hit "
                         "that pid afterwards (a live call was given up on)")

    def killed(self, run: Execution) -> bool:
        return any(run.pid in k.pids and k.at >= run.at - CLOCK_SLACK for k in self.kills)

    def check_transcript(self, by_key: Mapping[str, ToolCallRow],
                         messages: Sequence[ToolMessage]) -> None:
        """Every ended call has exactly one tool message, recording the status it ended in;
        a call that has not ended has none; no tool message belongs to no call."""
        written: dict[str, list[ToolMessage]] = defaultdict(list)
        for message in messages:
            written[message.key].append(message)
        self.figures["tool_messages"] = len(messages)
        for call in self.calls:
            mine = written.pop(call.key, [])
            if CallStatus(call.status) not in TERMINAL:
                if mine:
                    self.problem("tool_message_too_early", call,
                                 f"has {len(mine)} tool message(s) but has not ended")
            elif len(mine) != 1:
                self.problem("tool_message_count", call,
                             f"ended with {len(mine)} tool messages instead of one")
            elif mine[0].call_status != call.status:
                self.problem("tool_message_status", call,
                             f"its tool message says {mine[0].call_status}")
        for key, orphans in written.items():
            self.figures["violations.tool_message_orphan"] += 1
            self.verdict.violations.append(
                f"tool_message_orphan: {key}: {len(orphans)} tool message(s) of no stored call")

    def check_lost(self, call: ToolCallRow, attempt: int) -> None:
        """The system declared this attempt lost (child died, lease ran out): was it killed?"""
        self.figures["attempts_lost"] += 1
        runs = [r for r in self.runs.get(call.key, []) if r.attempt == attempt]
        if not runs:
            self.problem("lost_without_execution", call,
                         f"attempt {attempt} was declared lost but never reached the tool")
        elif not self.killed(runs[-1]):
            self.problem("lost_while_alive", call,
                         f"attempt {attempt} (pid {runs[-1].pid}) was declared lost, but no "
                         "kill hit that pid: a live attempt was reaped")


def check_run(
    calls: Sequence[ToolCallRow],
    ledger: Iterable[Mapping[str, Any]],
    kills: Sequence[Kill],
    intents: Mapping[str, str],
    lost: Sequence[tuple[str, int]] = (),
    tool_messages: Sequence[ToolMessage] | None = None,
) -> Verdict:
    """Check every guarantee a run can show; each broken one is a violation naming the call.

    * every call ended (terminal status);
    * no single-attempt key executed twice, no attempt of a retrying call executed twice, and
      no execution without a claimed attempt (ledger against the store);
    * succeeded calls ran; reads and idempotent writes failed only as "did not run" or with
      their attempts used up;
    * every "did not run" failure has the exact prefix and no ledger line;
    * every ``outcome_unknown`` has the exact prefix, belongs to a single-attempt call or an
      idempotent write out of attempts, and its last attempt's process was SIGKILLed after
      that attempt started (it has a ledger line, and a kill hit that very PID);
    * refunds left to expire were rejected for their deadline; approved ones were not rejected;
    * every attempt the system declared lost (``lost``: (key, attempt) pairs from the events)
      was really killed after it started: no live attempt was reaped;
    * given the transcripts' ``tool_messages``: every ended call has exactly one, recording
      the status it ended in, and a call that has not ended has none.
    """
    return _Checker(calls, executions(ledger), kills, intents, lost, tool_messages).run()
