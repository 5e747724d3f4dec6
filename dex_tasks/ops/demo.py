"""``dex-tasks demo``: the whole system on one machine, driven through every path, in a minute.

With no configuration it starts a real Redis server (:mod:`dex_tasks.ops.embedded`), a SQLite store
in a temporary folder, and ``dex-tasks worker``, ``beat`` and ``api`` as subprocesses, each in
its own process group. A scripted agent then runs one call per path (reads, a retried read, an
idempotent write, a single-attempt write, the seeds' quick-start ``cancel_order`` approved and
rejected over HTTP, an approval left to expire, a worker child killed mid-charge and reconciled)
and checks that each ends the way it announced. Like a model, it reads the session's transcript:
it records its own text there, and finally prints the transcript with every tool message.
``DEX_REDIS_URL`` / ``DEX_DATABASE_URL`` in the environment replace the embedded pieces.

Every process it starts is stopped on the way out, whether the run ends normally, fails, or is
interrupted (Ctrl-C, SIGTERM, SIGHUP): each group gets SIGTERM, then SIGKILL if it lingers.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dex_tasks.agent.client import DexClient
from dex_tasks.logs import redact
from dex_tasks.ops.embedded import (
    Interrupted,
    Stack,
    StackError,
    http_get,
    http_post,
    settings_from,
    signals_as_interrupts,
    signals_ignored,
)
from dex_tasks.ops.procutil import free_port
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT, CallStatus, MessageRole
from dex_tasks.store.records import AgentSnapshot, ToolCallRecord

TOOLS = "dex_tasks.examples.tools"
LEDGER_ENV = "DEX_EXAMPLE_LEDGER"

# Short windows so every path finishes in seconds; a user's own values win.
FAST_SETTINGS = {
    "DEX_LEASE_SECONDS": "5",
    "DEX_REPUBLISH_AFTER_SECONDS": "5",
    "DEX_SWEEP_INTERVAL_SECONDS": "0.5",
    "DEX_RETRY_BACKOFF_BASE_SECONDS": "0.1",
    "DEX_RETRY_BACKOFF_MAX_SECONDS": "0.5",
    "DEX_PUBLISH_TIMEOUT_SECONDS": "2",
}
EXPIRY_SECONDS = 3.0
"""The approval deadline of the call the demo leaves to expire."""

PATH_TIMEOUT = 40.0
"""How long one path may take before the demo calls it failed (CI machines are slow)."""


# -- the scripted agent -------------------------------------------------------------------------


@dataclass
class Check:
    """What a path saw: a short ``actual`` for the table, a longer ``detail`` for the log."""

    actual: str
    ok: bool
    detail: str = ""


@dataclass
class Outcome:
    """What one path announced and what happened."""

    path: str
    expected: str
    actual: str = "not run"
    ok: bool = False
    seconds: float = 0.0


class Agent:
    """Drives one session through every path and records each outcome."""

    def __init__(self, stack: Stack, console: Console, *, page_stays_up: bool = False) -> None:
        self.stack = stack
        self.console = console
        # Without --keep-running the API stops with the demo, so a link printed now would be
        # dead by the time anyone opens it: the session is named, the link is not.
        self.page_stays_up = page_stays_up
        self.client = DexClient(stack.settings)
        self.session = f"demo-{uuid.uuid4().hex[:8]}"
        self.secret = stack.settings.signing_key()
        self.outcomes: list[Outcome] = []
        self.crashed_key = ""
        self._turns = 0

    def close(self) -> None:
        self.client.close()

    def token(self, ttl: float = 3600, approver: str = "demo-approver") -> str:
        from dex_tasks.tokens import issue_token

        return issue_token(self.secret, self.session, ttl_seconds=ttl, approver=approver)

    def page_url(self, token: str) -> str:
        return f"{self.stack.api_url}/sessions/{self.session}?token={token}"

    def call(self, tool: str, arguments: dict[str, Any], **options: Any) -> ToolCallRecord:
        """One model turn: its text (recorded in the transcript), then its tool call."""
        self._turns += 1
        turn = f"t{self._turns}"
        shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        self.client.add_assistant_message(self.session, turn, f"Calling {tool}({shown}).")
        return self.client.call_tool(session_id=self.session, turn_id=turn, tool_call_id="c1",
                                     tool=tool, arguments=arguments, **options)

    def wait(self, key: str) -> ToolCallRecord:
        return self.client.wait(key, timeout=PATH_TIMEOUT)

    def step(self, path: str, expected: str, fn: Callable[[], Check]) -> Outcome:
        """Run one path with a spinner, print its line, and keep its outcome."""
        outcome = Outcome(path, expected)
        started = time.monotonic()
        with self.console.status(f"[bold]{path}[/]: expecting {expected}"):
            try:
                check = fn()
            except Exception as err:  # noqa: BLE001 - one broken path must not hide the rest
                check = Check(f"error: {type(err).__name__}", False, str(err))
        outcome.actual, outcome.ok = check.actual, check.ok
        outcome.seconds = time.monotonic() - started
        mark = "[green]ok[/]" if outcome.ok else "[red]FAILED[/]"
        self.console.print(f"{mark} [bold]{path}[/]: {check.actual} ({outcome.seconds:.1f}s)",
                           highlight=False)
        if check.detail:
            self.console.print(f"     [dim]{escape(check.detail)}[/]", highlight=False)
        self.outcomes.append(outcome)
        return outcome

    # -- the paths ------------------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        if self.page_stays_up:
            page_token = self.token(ttl=24 * 3600, approver="you (approval page)")
            self.console.print(f"\nsession [bold]{self.session}[/]; its approval page:\n"
                               f"  {self.page_url(page_token)}\n", highlight=False,
                               soft_wrap=True)
        else:
            self.console.print(f"\nsession [bold]{self.session}[/] (its approval page stops "
                               "with the demo: `dex-tasks demo --keep-running` keeps it up)\n",
                               highlight=False, soft_wrap=True)
        # Asked first so its deadline runs out while the other paths play.
        expiring = self.call("refund_payment", {"charge_id": "ch_expire", "amount_cents": 300},
                             approval_deadline=EXPIRY_SECONDS)

        self.step("read", "succeeded", self.read)
        self.step("read, service error", "failed at once, not retried", self.broken_read)
        self.step("flaky read", "succeeded on attempt 3 (2 transient failures retried)",
                  self.flaky_read)
        self.step("idempotent write", "succeeded once; the repeated request is the same call",
                  self.idempotent_write)
        self.step("single-attempt write", "succeeded, 1 attempt", self.single_attempt_write)
        self.step("approval granted (HTTP)", "cancel_order awaiting_approval, then succeeded",
                  self.approval_granted)
        self.step("approval rejected (HTTP)", "rejected, the model reads the message",
                  self.approval_rejected)
        self.step("worker killed mid-charge", "outcome_unknown, never run again",
                  self.killed_mid_charge)
        self.step("approval left to expire", f"rejected after its {EXPIRY_SECONDS:g}s deadline",
                  lambda: self.approval_expired(expiring.key))
        self.step("reconciliation", "the unknown charge is checked, reported exactly once",
                  self.reconcile)
        self.step("transcript", "one tool message per ended call, the report after it",
                  self.transcript)
        print_transcript(self.console, self.client.get_agent_snapshot(self.session))
        self.step("metrics", "/metrics counts the calls", self.metrics)
        return self.outcomes

    def read(self) -> Check:
        rec = self.wait(self.call("lookup_order", {"order_id": "1001"}).key)
        return Check(f"{rec.status.value}, {rec.attempts} attempt",
                     rec.status is CallStatus.SUCCEEDED and rec.attempts == 1, str(rec.result))

    def broken_read(self) -> Check:
        rec = self.wait(self.call("broken_report", {"report": "q3-returns"}).key)
        return Check(f"{rec.status.value}, {rec.attempts} attempt",
                     rec.status is CallStatus.FAILED and rec.attempts == 1, str(rec.error))

    def flaky_read(self) -> Check:
        rec = self.wait(self.call("flaky_lookup", {"order_id": "1002", "fail_times": 2}).key)
        return Check(f"{rec.status.value} on attempt {rec.attempts}",
                     rec.status is CallStatus.SUCCEEDED and rec.attempts == 3, str(rec.result))

    def idempotent_write(self) -> Check:
        args = {"order_id": "1001", "address": "12 Rue des Lilas, Lyon"}
        first = self.call("update_address", args)
        rec = self.wait(first.key)
        # The agent process repeats its request (say its own timeout fired): same key, same call.
        again = self.client.call_tool(session_id=self.session, turn_id=first.turn_id,
                                      tool_call_id=first.tool_call_id, tool="update_address",
                                      arguments=args)
        runs = self.executions(first.key)
        return Check(f"{rec.status.value}, tool ran {runs}x",
                     rec.status is CallStatus.SUCCEEDED and again.key == rec.key and runs == 1,
                     f"the repeated request returned the same call ({again.status.value})")

    def single_attempt_write(self) -> Check:
        rec = self.wait(self.call("charge_card", {"customer_id": "cu_42",
                                                  "amount_cents": 1999}).key)
        return Check(f"{rec.status.value}, {rec.attempts} attempt",
                     rec.status is CallStatus.SUCCEEDED and rec.attempts == 1, str(rec.result))

    def _await_approval(self, order_id: str) -> ToolCallRecord:
        # The seeds' quick-start tool: a non-idempotent write, so it waits for a person.
        rec = self.call("cancel_order", {"order_id": order_id,
                                         "reason": "the customer changed their mind"})
        if rec.status is not CallStatus.AWAITING_APPROVAL or rec.interrupt_id is None:
            raise AssertionError(f"expected awaiting_approval, got {rec.status.value}")
        return rec

    def _resolve(self, rec: ToolCallRecord, approved: bool,
                 message: str | None = None) -> bool | None:
        """POST /interrupts/resolve with a signed token; ``accepted``, or None on an error."""
        assert rec.interrupt_id is not None
        status, body = http_post(f"{self.stack.api_url}/interrupts/resolve", {
            "session_id": self.session, "interrupt_id": rec.interrupt_id,
            "approved": approved, "rejection_message": message,
        }, token=self.token())
        if status != 200:
            raise AssertionError(f"POST /interrupts/resolve answered {status}: {body[:200]}")
        accepted = json.loads(body).get("accepted")
        return accepted if isinstance(accepted, bool) else None

    def approval_granted(self) -> Check:
        rec = self._await_approval("1002")
        accepted = self._resolve(rec, approved=True)
        final = self.wait(rec.key)
        return Check(f"approved, then {final.status.value}",
                     accepted is True and final.status is CallStatus.SUCCEEDED,
                     f"accepted={accepted}; {final.result}")

    def approval_rejected(self) -> Check:
        message = "Order 1001 has shipped; offer a return instead of a cancellation."
        rec = self._await_approval("1001")
        accepted = self._resolve(rec, approved=False, message=message)
        final = self.wait(rec.key)
        # Deciding again is safe: the first decision stands.
        again = self._resolve(rec, approved=True)
        return Check(f"{final.status.value}; a 2nd decision: accepted={again}",
                     accepted is True and final.status is CallStatus.REJECTED
                     and message in (final.error or "") and again is False,
                     str(final.error))

    def killed_mid_charge(self) -> Check:
        rec = self.call("charge_card", {"customer_id": "cu_7", "amount_cents": 4200,
                                        "sleep": 120})
        pid = self._running_pid(rec.key)
        if not self.stack.procs["worker"].owns(pid):
            return Check(f"ran in pid {pid}, outside the demo's worker", False,
                         "another worker shares this Redis; the demo will not kill it")
        os.kill(pid, signal.SIGKILL)
        self.crashed_key = rec.key
        final = self.wait(rec.key)
        runs = self.executions(rec.key)
        return Check(f"{final.status.value}, tool ran {runs}x",
                     final.status is CallStatus.OUTCOME_UNKNOWN and runs == 1
                     and (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT),
                     f"pool child {pid} SIGKILLed mid-charge; {final.error}")

    def approval_expired(self, key: str) -> Check:
        from dex_tasks.store.deadlines import APPROVAL_DEADLINE_PASSED

        final = self.wait(key)
        return Check(f"{final.status.value}, deadline passed",
                     final.status is CallStatus.REJECTED
                     and (final.error or "").startswith(APPROVAL_DEADLINE_PASSED),
                     str(final.error))

    def reconcile(self) -> Check:
        import dex_tasks.examples.tools  # noqa: F401 - registers charge_card's reconciler here
        from dex_tasks.agent.async_client import AsyncDexClient
        from dex_tasks.agent.reconcile import report_unknown_outcomes
        from dex_tasks.worker.reconcilers import reconciler_for

        checker = reconciler_for("charge_card")
        if checker is None:
            return Check("charge_card has no reconciler", False)

        async def check(key: str, arguments_json: str) -> str | None:
            # The example reconciler asks the "payment provider" (the ledger) by key.
            with _environ(LEDGER_ENV, self.stack.env[LEDGER_ENV]):
                return checker(key, json.loads(arguments_json))

        # The seeds' shape: a coroutine over anything with async get_agent_snapshot and
        # send_user_message. Not closed: it shares this agent's client.
        sessions = AsyncDexClient(client=self.client)
        # Beat's reconcile sweep runs the same checker in the worker: whichever asks first
        # reports, the other finds the call already reported. Either way, exactly one message.
        first = asyncio.run(report_unknown_outcomes(sessions, self.session, check))

        def reports() -> list[str]:
            snapshot = self.client.get_agent_snapshot(self.session)
            return [m.text for m in snapshot.messages
                    if m.role is MessageRole.USER and m.text and self.crashed_key
                    and self.crashed_key in m.text and m.status == "delivered"]

        texts = _poll(reports, PATH_TIMEOUT)
        again = asyncio.run(report_unknown_outcomes(sessions, self.session, check))
        by = "the agent's check" if first else "beat's reconcile sweep"
        return Check(f"{len(texts)} report (by {by}), {len(again)} on a 2nd run",
                     len(texts) == 1 and not again,
                     f"the session reads: {texts[0] if texts else '(nothing)'}")

    def transcript(self) -> Check:
        """Read the transcript as the model would: a tool message per ended call, in order."""
        snapshot = self.client.get_agent_snapshot(self.session)
        tools = [m for m in snapshot.messages if m.role is MessageRole.TOOL]
        ended = {c.key: c.status for c in snapshot.tool_calls if c.terminal}
        one_each = Counter(m.key for m in tools) == Counter(dict.fromkeys(ended, 1))
        statuses_match = all(ended.get(m.key or "") is m.call_status for m in tools)
        crash = next((m for m in tools if m.key == self.crashed_key), None)
        crash_at = snapshot.messages.index(crash) if crash is not None else -1
        report_after = any(m.role is MessageRole.USER and self.crashed_key in (m.text or "")
                           for m in snapshot.messages[crash_at + 1:]) if crash else False
        unknown_read = crash is not None and OUTCOME_UNKNOWN_TOOL_RESULT in (
            crash.tool_output or "")
        said = sum(m.role is MessageRole.ASSISTANT for m in snapshot.messages)
        return Check(f"{len(snapshot.messages)} messages: {len(tools)} tool, {said} assistant",
                     one_each and statuses_match and unknown_read and report_after
                     and said == self._turns,
                     f"{len(ended)} ended calls; the crashed charge's tool message says "
                     f"{OUTCOME_UNKNOWN_TOOL_RESULT if unknown_read else '(missing)'} and the "
                     f"report {'follows it' if report_after else 'is missing'}")

    def metrics(self) -> Check:
        status, body = http_get(f"{self.stack.api_url}/metrics",
                                token=self.stack.env["DEX_METRICS_TOKEN"])
        wanted = f'status="{CallStatus.OUTCOME_UNKNOWN.value}"'
        line = next((ln for ln in body.splitlines()
                     if ln.startswith("dex_tool_calls_ended_total{") and wanted in ln), "")
        # At least this run's charge (a store of yours may hold earlier runs' calls too).
        count = float(line.rsplit(" ", 1)[1]) if line else 0.0
        return Check(f"HTTP {status}, {count:g} outcome_unknown call(s)",
                     status == 200 and count >= 1, line or "no such line")

    # -- helpers --------------------------------------------------------------------------------

    def executions(self, key: str) -> int:
        from dex_tasks.examples import ledger

        return ledger.executions(self.stack.env[LEDGER_ENV])[key]

    def _running_pid(self, key: str) -> int:
        from dex_tasks.examples import ledger

        deadline = time.monotonic() + PATH_TIMEOUT
        while time.monotonic() < deadline:
            for entry in ledger.read(self.stack.env[LEDGER_ENV]):
                if entry["key"] == key:
                    return int(entry["pid"])
            time.sleep(0.02)
        raise TimeoutError(f"the charge {key} did not start within {PATH_TIMEOUT:.0f}s")


def _poll(fn: Callable[[], list[str]], timeout: float) -> list[str]:
    """``fn()`` once it returns something, or its last (empty) answer after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """Set one environment variable of this process for the duration of a block."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


# -- orchestration ------------------------------------------------------------------------------


def build_env(workdir: Path, base: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment of the demo's processes, and what the user configured themselves."""
    env = dict(base)
    own = [name for name in ("DEX_REDIS_URL", "DEX_DATABASE_URL") if env.get(name)]
    env.setdefault("DEX_DATABASE_URL", f"sqlite:///{workdir / 'dex.db'}")
    env.setdefault("DEX_STATE_DIR", str(workdir / "state"))
    if not env.get("DEX_SECRET_KEY"):
        env["DEX_SECRET_KEY"] = secrets.token_urlsafe(32)
    if not env.get("DEX_METRICS_TOKEN"):
        env["DEX_METRICS_TOKEN"] = secrets.token_urlsafe(32)
    for name, value in FAST_SETTINGS.items():
        env.setdefault(name, value)
    env.setdefault(LEDGER_ENV, str(workdir / "ledger.jsonl"))
    env["PYTHONUNBUFFERED"] = "1"
    return env, own


def transcript_lines(snapshot: AgentSnapshot) -> list[str]:
    """The session's transcript as the model reads it, one line per message: who, the turn,
    and the text (a tool message: the tool, the call's status and its output)."""
    lines = []
    for m in snapshot.messages:
        if m.role is MessageRole.TOOL:
            status = m.call_status.value if m.call_status else ""
            what = f"{m.tool} {status}: {m.tool_output or ''}"
        elif m.role is MessageRole.USER:
            what = f"({m.status}) {m.text or ''}"
        else:
            what = m.text or ""
        lines.append(f"  {m.role.value:<9} {m.turn_id or '':<4} {what}")
    return lines


def print_transcript(console: Console, snapshot: AgentSnapshot) -> None:
    """Print :func:`transcript_lines`, each cut to the terminal's width."""
    console.print(f"\nthe transcript of {snapshot.session_id}, as the model reads it:",
                  highlight=False)
    for line in transcript_lines(snapshot):
        console.print(line, no_wrap=True, overflow="ellipsis", markup=False, highlight=False)
    console.print()


def summary_table(outcomes: list[Outcome]) -> Table:
    """The end-of-run table: path, expected outcome, actual, ok."""
    table = Table(title="dex-tasks demo", show_lines=False)
    table.add_column("path", style="bold")
    table.add_column("expected")
    table.add_column("actual")
    table.add_column("ok", justify="center")
    for o in outcomes:
        table.add_row(o.path, o.expected, o.actual, "[green]ok[/]" if o.ok else "[red]FAILED[/]")
    return table


class Demo:
    """One run of the demo: the stack, the agent, and the result so far."""

    def __init__(self, console: Console, keep_running: bool) -> None:
        self.console = console
        self.keep_running = keep_running
        self.workdir = Path(tempfile.mkdtemp(prefix="dex-demo-"))
        self.user_settings = {name for name in os.environ if name.startswith("DEX_")}
        env, self.own = build_env(self.workdir, dict(os.environ))
        self.stack = Stack(self.workdir, env, settings_from(env))
        self.agent: Agent | None = None
        self.code: int | None = None  # set once the summary is printed

    def run(self) -> int:
        """Start, drive, summarise, stop; the process exit code."""
        interrupted = False
        with signals_as_interrupts():
            try:
                self._start()
                self._drive()
                if self.keep_running:
                    self._hold()
            except (KeyboardInterrupt, Interrupted):
                interrupted = True
            except StackError as err:
                self.console.print(f"[red]the demo stack failed:[/] {err}", highlight=False)
            finally:
                self._stop()
        if self.code is None:
            if interrupted:
                self.console.print("interrupted; every process the demo started was stopped.")
                return 130
            self.code = 1
        if self.code == 0:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            self.console.print(f"logs kept in {self.workdir}", highlight=False)
        return self.code

    def _start(self) -> None:
        stack, console = self.stack, self.console
        where = (" and ".join(n.removeprefix("DEX_").removesuffix("_URL").title()
                              for n in self.own) + " from your environment") if self.own \
            else "an embedded Redis and SQLite"
        console.print(f"[bold]dex-tasks demo[/]: a worker, beat and the API on {where}",
                      highlight=False)
        if "DEX_REDIS_URL" not in self.own:
            with console.status("starting Redis..."):
                server = stack.start_redis()
            console.print(f"  Redis     {server.url}  (redis-server from "
                          f"{server.origin}, pid {server.pid})", highlight=False)
        else:
            console.print(f"  Redis     {redact(stack.env['DEX_REDIS_URL'])}  (yours: other "
                          "workers on it may pick up the demo's calls)", highlight=False)
        console.print(f"  store     {redact(stack.env['DEX_DATABASE_URL'])}", highlight=False)
        port = free_port()
        stack.api_url = f"http://127.0.0.1:{port}"
        with console.status("starting the worker, beat and the API..."):
            stack.start("worker", ["worker", "--tools", TOOLS, "-c", "2"])
            stack.start("beat", ["beat"])
            stack.start("api", ["api", "--host", "127.0.0.1", "--port", str(port)])
            stack.wait_ready()
        for name, proc in stack.procs.items():
            console.print(f"  {name:<9} pid {proc.pid}, log {proc.log_path}", highlight=False)
        console.print(f"  API       {stack.api_url}/docs", highlight=False)
        console.print(f"  metrics   {self.metrics_command()}", highlight=False, soft_wrap=True)

    def _drive(self) -> None:
        self.agent = Agent(self.stack, self.console, page_stays_up=self.keep_running)
        outcomes = self.agent.run()
        self.console.print()
        self.console.print(summary_table(outcomes))
        failed = [o.path for o in outcomes if not o.ok]
        if failed:
            self.console.print(f"[red]{len(failed)} path(s) did not reach the announced "
                               f"outcome:[/] {', '.join(failed)}", highlight=False)
        else:
            self.console.print(f"[green]all {len(outcomes)} paths reached the outcome they "
                               "announced.[/]")
        self.code = 1 if failed else 0

    def _hold(self) -> None:
        """--keep-running: leave one approval for a person, print the links, wait for Ctrl-C."""
        agent, stack = self.agent, self.stack
        assert agent is not None
        pending = agent.call("refund_payment", {"charge_id": "ch_for_you", "amount_cents": 2500})
        token = agent.token(ttl=24 * 3600, approver="you (approval page)")
        self.console.print(
            f"\nThe stack keeps running. A refund is waiting for [bold]your[/] decision "
            f"({pending.key}):\n  {agent.page_url(token)}\n"
            f"  API docs {stack.api_url}/docs\n  metrics  {self.metrics_command()}\n"
            "Press Ctrl-C to stop every process.", highlight=False, soft_wrap=True)
        while True:
            for name, proc in stack.procs.items():
                if not proc.alive():
                    raise StackError(f"dex-tasks {name} exited:\n{proc.tail()}")
            time.sleep(0.5)

    def metrics_command(self) -> str:
        """How to read /metrics: it needs the metrics token as a Bearer header (a browser's
        link would answer 401), so the command shows the token, unless it is the user's own."""
        url = f"{self.stack.api_url}/metrics"
        if "DEX_METRICS_TOKEN" in self.user_settings:
            return f'curl -H "Authorization: Bearer $DEX_METRICS_TOKEN" {url}'
        return f'curl -H "Authorization: Bearer {self.stack.env["DEX_METRICS_TOKEN"]}" {url}'

    def _stop(self) -> None:
        with signals_ignored():
            if self.agent is not None:
                self.agent.close()
            started = time.monotonic()
            self.console.print("stopping the demo's processes...")
            self.stack.stop()
            self.console.print(f"stopped in {time.monotonic() - started:.1f}s.")


def run(*, keep_running: bool = False, console: Console | None = None) -> int:
    """Start the stack, drive every path, print the summary; 0 only if every path was ok."""
    return Demo(console or Console(), keep_running).run()
