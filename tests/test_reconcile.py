"""Reconciliation of ``outcome_unknown`` calls: reports reach the session once, and only once,
whoever sends them (the seeds' own steps, dex-tasks' async and sync forms, beat's per-tool
checkers), in any order and when they race."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

import workers.example_tools  # noqa: F401 - registers charge_card and its reconciler here too
from dex_tasks import (
    AgentSnapshot,
    AsyncDexClient,
    CallStatus,
    DexClient,
    DexSettings,
    MessageRole,
    report_unknown_outcomes,
    report_unknown_outcomes_sync,
    tool,
)
from dex_tasks.agent.reconcile import InvalidCheckResultError
from dex_tasks.broker.celery_app import SWEEP
from dex_tasks.registry import ToolContext
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT
from dex_tasks.store import MESSAGES
from dex_tasks.store.transcript import names_key
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.reconcilers import reconcile_with_reconcilers
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import (
    ROOT,
    WorkerProcess,
    dex_command,
    start_process,
    user_messages,
    wait_until,
)
from workers import ledger


def _charge(client: DexClient, session_id: str, call_id: str, cents: int) -> str:
    record = client.call_tool(session_id=session_id, turn_id="t1", tool_call_id=call_id,
                              tool="charge_card",
                              arguments={"customer_id": "cu_1", "amount_cents": cents,
                                         "sleep": 30})
    return record.key


def _kill_mid_run(ledger_path: Path, keys: list[str]) -> None:
    """SIGKILL the children running ``keys`` once the ledger shows each has started."""
    def pids() -> dict[str, int] | None:
        found = {e["key"]: int(e["pid"]) for e in ledger.read(ledger_path) if e["key"] in keys}
        return found if len(found) == len(keys) else None

    for pid in wait_until(pids, 20, f"{keys} to start").values():
        os.kill(pid, signal.SIGKILL)


def _sweep(client: DexClient) -> int:
    """Run the reconcile_unknown job once in this process (which has the tools imported)."""
    conn = redis.Redis.from_url(client.settings.redis_url)
    try:
        rt = Runtime(settings=client.settings, store=client.store, redis=conn, app=client.app)
        return run_job(rt, "reconcile_unknown")
    finally:
        conn.close()


def _messages(client: DexClient, session_id: str) -> list[str]:
    return [m.text or "" for m in user_messages(client.get_agent_snapshot(session_id))]


def _reconcile_cli(env: dict[str, str], session_id: str) -> str:
    done = subprocess.run(
        [*dex_command(), "reconcile", session_id, "--tools", "workers.example_tools"],
        cwd=ROOT, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_killed_charges_are_reconciled_once_by_check_cli_and_worker_sweep(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, env: dict[str, str]
) -> None:
    # Given three charges whose worker children are SIGKILLed mid-charge (real outcome_unknown)
    start_worker(concurrency=3)
    c1 = _charge(client, "s1", "c1", 100)
    c2 = _charge(client, "s1", "c2", 200)
    c3 = _charge(client, "s2", "c3", 300)
    _kill_mid_run(ledger_path, [c1, c2, c3])
    for key in (c1, c2, c3):
        final = client.wait(key, timeout=20)
        assert final.status is CallStatus.OUTCOME_UNKNOWN
        assert (final.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)

    # When an operator's check knows about c1 only
    asked: list[tuple[str, str]] = []

    def check(key: str, arguments_json: str) -> str | None:
        asked.append((key, arguments_json))
        return "Note from the payment system: charge 1 went through." if key == c1 else None

    reports = report_unknown_outcomes_sync(client, "s1", check)

    # Then c1's answer is sent into the session, naming the key; c2 waits for an answer
    assert reports == [f"Note from the payment system: charge 1 went through. (tool call {c1})"]
    assert sorted(k for k, _ in asked) == [c1, c2]
    assert '"amount_cents":100' in dict(asked)[c1]
    assert _messages(client, "s1") == reports
    # ... and running it again sends nothing new and does not ask about c1 again
    asked.clear()
    assert report_unknown_outcomes_sync(client, "s1", check) == []
    assert [k for k, _ in asked] == [c2]

    # When the CLI runs charge_card's registered reconciler for session s2
    out = _reconcile_cli(env, "s2")
    # Then it reports c3 (the ledger, standing in for the provider, shows it went through)
    assert f"reported {c3}" in out, out
    assert len(_messages(client, "s2")) == 1
    assert "went through" in _messages(client, "s2")[0]
    assert c3 in _messages(client, "s2")[0]

    # When beat's reconcile_unknown job runs in the worker (where the tools are imported)
    client.app.send_task(SWEEP, args=["reconcile_unknown"])
    # Then the worker reports c2, the only call left, and nothing else
    wait_until(lambda: len(_messages(client, "s1")) == 2, 20, "the sweep to report c2")
    assert "went through" in _messages(client, "s1")[1] and c2 in _messages(client, "s1")[1]

    # And every later run sends nothing new: the check, the CLI, the sweep
    assert report_unknown_outcomes_sync(client, "s1", lambda k, a: "again") == []
    assert "nothing to report" in _reconcile_cli(env, "s2")
    assert _sweep(client) == 0
    assert len(_messages(client, "s1")) == 2 and len(_messages(client, "s2")) == 1
    assert ledger.executions(ledger_path)[c1] == 1


# -- the store side, on SQLite and PostgreSQL (no worker needed: calls are ended directly) -----


@tool(effect="non_idempotent_write", requires_approval=False, name="recon_test_transfer")
def recon_test_transfer(ctx: ToolContext, amount: int) -> dict[str, Any]:
    """A transfer used only to create outcome_unknown calls here."""
    return {"amount": amount}


@recon_test_transfer.reconciler
def _check_transfer(key: str, arguments: dict[str, Any]) -> str | None:
    if arguments["amount"] == 13:
        raise RuntimeError("the bank's API is down")
    if arguments["amount"] == 0:
        return None
    return f"Note from the bank: the transfer of {arguments['amount']} went through."


def _unknown(client: DexClient, session_id: str, call_id: str, amount: int,
             turn_id: str = "t1") -> str:
    """A call of the session ended outcome_unknown (through the guarded transition)."""
    key = client.call_tool(session_id=session_id, turn_id=turn_id, tool_call_id=call_id,
                           tool="recon_test_transfer", arguments={"amount": amount}).key
    assert client.store.transition(
        key, CallStatus.OUTCOME_UNKNOWN, values={"error": f"{OUTCOME_UNKNOWN_TOOL_RESULT}: test"}
    )
    return key


@pytest.fixture
def store_client(redis_url: str, database_url: str) -> Any:
    # No worker consumes this Redis db: the calls stay queued until the test ends them.
    with DexClient(fast_settings(redis_url, database_url)) as c:
        yield c


def _report_count(client: DexClient) -> int:
    with client.store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(MESSAGES).where(
            MESSAGES.c.text.like("%(tool call %"))).scalar_one())


def test_registered_reconcilers_unknown_answers_errors_and_open_turns(
    store_client: DexClient,
) -> None:
    client = store_client
    ok = _unknown(client, "s", "ok", 50)
    later = _unknown(client, "s", "later", 0)
    broken = _unknown(client, "s", "broken", 13)
    # A call of another turn is still queued: the turn is open, so messages wait for it
    open_turn = client.call_tool(session_id="s", turn_id="t2", tool_call_id="open",
                                 tool="recon_test_transfer", arguments={"amount": 1}).key

    result = reconcile_with_reconcilers(client.store, "s")

    # Then the answered call is reported; "not known yet" and a failing checker send nothing
    assert [r.key for r in result.reported] == [ok]
    assert result.unanswered == [later]
    assert list(result.failed) == [broken] and "bank's API is down" in result.failed[broken]
    messages = user_messages(client.get_agent_snapshot("s"))
    assert [m.text for m in messages] == [
        f"Note from the bank: the transfer of 50 went through. (tool call {ok})"
    ]
    assert messages[0].status == "queued"
    # When the open turn's call ends, the report is delivered with it
    assert client.store.transition(open_turn, CallStatus.FAILED, values={"error": "x"})
    assert user_messages(client.get_agent_snapshot("s"))[0].status == "delivered"

    # The sweep (every session, tools with checkers here) sends nothing new; nor a rerun
    assert _sweep(client) == 0
    assert reconcile_with_reconcilers(client.store, "s").reported == []
    assert _report_count(client) == 1

    # A check must answer with text or None
    with pytest.raises(InvalidCheckResultError, match="str or None, got int"):
        report_unknown_outcomes_sync(client, "s", lambda key, args: 42)  # type: ignore[arg-type]


# -- the seeds' steps, in our own words, and dex-tasks' reconcilers: one rule ------------------


async def seeds_steps(sessions: Any, session_id: str,
                      check: Callable[[str, str], Awaitable[str]]) -> list[str]:
    """The steps the seeds' reconciliation sample takes, as its prose lists them: read the
    session, find tool results that say the outcome is unknown, rebuild each call's key from
    its turn and tool-call ids, skip a key some user message already contains, ask, report.
    Like the sample, it does not look at what ``send_user_message`` answered."""
    snapshot = await sessions.get_agent_snapshot(session_id)
    said = [m.text or "" for m in snapshot.messages if m.role == MessageRole.USER]
    sent: list[str] = []
    for message in snapshot.messages:
        if OUTCOME_UNKNOWN_TOOL_RESULT not in (message.tool_output or ""):
            continue
        key = f"{session_id}/{message.turn_id}/{message.tool_call_id}"
        if any(key in text for text in said):
            continue
        answer = await check(key, message.tool_arguments or "{}")
        report = f"{answer} (tool call {key})"
        await sessions.send_user_message(session_id, report)
        sent.append(report)
    return sent


class StaleSessions:
    """Answers with a snapshot read earlier: a reconciler that read before another reported."""

    def __init__(self, client: AsyncDexClient, snapshot: AgentSnapshot) -> None:
        self.client, self.snapshot, self.answers = client, snapshot, list[bool]()

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
        return self.snapshot

    async def send_user_message(self, session_id: str, text: str) -> bool:
        self.answers.append(await self.client.send_user_message(session_id, text))
        return self.answers[-1]


def _reports_of(client: DexClient, session_id: str, key: str) -> list[str]:
    return [text for text in _messages(client, session_id) if key in text]


def test_seeds_steps_twice_then_every_reconciler_leave_one_report(
    redis_url: str, database_url: str, ledger_path: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = fast_settings(redis_url, database_url)
    env = settings_env(settings, ledger_path)
    monkeypatch.setenv(ledger.ENV, str(ledger_path))  # charge_card's checker asks the ledger
    worker = WorkerProcess(start_process(["worker", "--tools", "workers.example_tools", "-c",
                                          "2"], env, tmp_path / "worker.log"),
                           tmp_path / "worker.log").wait_ready()
    asked: list[str] = []

    async def check(key: str, arguments_json: str) -> str:
        asked.append(key)
        return f"Note from the payment system: {json.loads(arguments_json)['amount_cents']} " \
               "cents were charged."

    try:
        with DexClient(settings) as client:
            # Given two charges (sessions s1 and s2) whose children are SIGKILLed mid-charge
            s1, s2 = _charge(client, "s1", "c1", 100), _charge(client, "s2", "c1", 200)
            _kill_mid_run(ledger_path, [s1, s2])
            for key in (s1, s2):
                assert client.wait(key, timeout=30).status is CallStatus.OUTCOME_UNKNOWN

            async def s1_seeds_first() -> tuple[list[str], list[str], list[str], StaleSessions]:
                async with AsyncDexClient(client=DexClient(settings)) as sessions:
                    before = await sessions.get_agent_snapshot("s1")
                    # When the seeds' steps run twice on s1
                    first = await seeds_steps(sessions, "s1", check)
                    second = await seeds_steps(sessions, "s1", check)
                    # ... then dex-tasks' async form, and both again on a stale snapshot
                    ours = await report_unknown_outcomes(sessions, "s1", check)
                    stale = StaleSessions(sessions, before)
                    assert await report_unknown_outcomes(stale, "s1", check) == []
                    await seeds_steps(stale, "s1", check)
                    return first, second, ours, stale

            first, second, ours, stale = asyncio.run(s1_seeds_first())
            # Then the first run reported, the second found the report and sent nothing
            assert first == [f"Note from the payment system: 100 cents were charged. "
                             f"(tool call {s1})"] and second == [] and ours == []
            # ... and the store refused both sends made from the stale read
            assert stale.answers == [False, False]
            # When the sync form, the CLI and beat's reconcile job (with charge_card's
            # registered checker) run, s1 gets nothing more; s2 is reported by the job
            assert report_unknown_outcomes_sync(client, "s1", lambda k, a: "again") == []
            assert "nothing to report" in _reconcile_cli(env, "s1")
            assert _sweep(client) == 1
            assert _reports_of(client, "s1", s1) == first

            # When the seeds' steps and dex-tasks' forms run on s2 after the job reported it
            async def s2_after_the_job() -> tuple[list[str], list[str]]:
                async with AsyncDexClient(client=DexClient(settings)) as sessions:
                    return (await seeds_steps(sessions, "s2", check),
                            await report_unknown_outcomes(sessions, "s2", check))

            assert asyncio.run(s2_after_the_job()) == ([], [])
            assert report_unknown_outcomes_sync(client, "s2", lambda k, a: "again") == []
            # Then each session holds exactly one report; the check was asked about s1 by the
            # first run and the two stale ones only, and never about s2
            [report] = _reports_of(client, "s2", s2)
            assert "went through" in report and report.endswith(f"(tool call {s2})")
            assert len(_messages(client, "s1")) == len(_messages(client, "s2")) == 1
            assert asked == [s1] * 3
    finally:
        worker.discard()


# -- racing reconcilers (threads and processes), on both stores ---------------------------------

_RACE: dict[str, threading.Barrier] = {}


@tool(effect="non_idempotent_write", requires_approval=False, name="recon_race_transfer")
def recon_race_transfer(ctx: ToolContext, amount: int) -> dict[str, Any]:
    """A transfer whose registered checker waits for the other racers (see _RACE)."""
    return {"amount": amount}


@recon_race_transfer.reconciler
def _check_race(key: str, arguments: dict[str, Any]) -> str:
    if "barrier" in _RACE:
        _RACE["barrier"].wait()
    return f"Note from the bank: {arguments['amount']} moved (beat's checker)."


def _race_calls(client: DexClient, count: int) -> list[str]:
    keys = []
    for i in range(count):
        key = client.call_tool(session_id="race", turn_id="t1", tool_call_id=f"c{i}",
                               tool="recon_race_transfer", arguments={"amount": i}).key
        assert client.store.transition(key, CallStatus.OUTCOME_UNKNOWN,
                                       values={"error": f"{OUTCOME_UNKNOWN_TOOL_RESULT}: t"})
        keys.append(key)
    return keys


def _one_report_per_key(client: DexClient, keys: list[str]) -> None:
    texts = _messages(client, "race")
    assert len(texts) == len(keys), texts
    for key in keys:
        assert len([t for t in texts if t.endswith(f"(tool call {key})")]) == 1, texts


def test_reconcilers_of_every_kind_racing_in_threads_report_each_call_once(
    store_client: DexClient,
) -> None:
    client = store_client
    keys = _race_calls(client, 3)
    kinds = ("seeds", "async", "sync", "beat") * 2
    # Every racer has read the transcript and is inside its check before any of them sends.
    barrier = threading.Barrier(len(kinds), timeout=30)
    _RACE["barrier"] = barrier

    async def async_check(key: str, arguments_json: str) -> str:
        await asyncio.to_thread(barrier.wait)
        return f"Note from the bank: {arguments_json} moved."

    def sync_check(key: str, arguments_json: str) -> str:
        barrier.wait()
        return f"Note from the bank: {arguments_json} moved."

    async def run_async(kind: str) -> None:
        # Not closed here: it wraps the test's client, which the other racers still use.
        sessions = AsyncDexClient(client=client)
        if kind == "seeds":
            await seeds_steps(sessions, "race", async_check)
        else:
            await report_unknown_outcomes(sessions, "race", async_check)

    def run(kind: str) -> None:
        if kind == "sync":
            report_unknown_outcomes_sync(client, "race", sync_check)
        elif kind == "beat":
            result = reconcile_with_reconcilers(client.store, "race")
            assert not result.failed, result.failed
        else:
            asyncio.run(run_async(kind))

    errors: list[BaseException] = []

    def guarded(kind: str) -> None:
        try:
            run(kind)
        except BaseException as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(kind,)) for kind in kinds]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        _RACE.clear()
    assert errors == []
    _one_report_per_key(client, keys)


def _seeds_steps_in_child(redis_url: str, database_url: str, barrier: Any, out: Any) -> None:
    """Runs in its own process: its own client and store connections."""
    settings = DexSettings(redis_url=redis_url, database_url=database_url)

    async def check(key: str, arguments_json: str) -> str:
        await asyncio.to_thread(barrier.wait, 30)
        return f"Note from the bank (pid {os.getpid()}): {arguments_json} moved."

    async def steps() -> list[str]:
        async with AsyncDexClient(settings, create_tables=False) as sessions:
            return await seeds_steps(sessions, "race", check)

    out.put(asyncio.run(steps()))


def test_the_seeds_steps_racing_in_processes_leave_one_report_per_call(
    store_client: DexClient, redis_url: str, database_url: str,
) -> None:
    keys = _race_calls(store_client, 2)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_seeds_steps_in_child,
                         args=(redis_url, database_url, barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    # Each process read the transcript before any sent, so each believes it reported both
    assert [len(out.get(timeout=60)) for _ in procs] == [2] * 4
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    _one_report_per_key(store_client, keys)


# -- the rule itself ----------------------------------------------------------------------------


def test_the_store_stores_one_report_per_unknown_call(store_client: DexClient) -> None:
    client = store_client
    c1 = _unknown(client, "s", "c1", 1)
    c10 = _unknown(client, "s", "c10", 10)
    done = client.call_tool(session_id="s", turn_id="t1", tool_call_id="done",
                            tool="recon_test_transfer", arguments={"amount": 2}).key
    assert client.store.transition(done, CallStatus.FAILED, values={"error": "declined"})

    # A second report of the same call is refused and stores nothing
    assert client.send_user_message("s", f"The bank says it went through. (tool call {c10})")
    assert not client.send_user_message("s", f"Went through, again. (tool call {c10})")
    assert _messages(client, "s") == [f"The bank says it went through. (tool call {c10})"]
    # A report of c10 does not count as one of c1, whose key is a prefix of c10's
    assert [r.key for r in reconcile_with_reconcilers(client.store, "s").reported] == [c1]
    # A message naming a call that did not end outcome_unknown is an ordinary message
    for _ in range(2):
        assert client.send_user_message("s", f"About that one. (tool call {done})")
    assert len(_messages(client, "s")) == 4

    # A user naming a call in their own words counts as reported: no reconciler reports it
    c2 = _unknown(client, "s", "c2", 2)
    assert client.send_user_message("s", f"I checked {c2} with the bank myself: it failed.")
    assert reconcile_with_reconcilers(client.store, "s").reported == []
    assert report_unknown_outcomes_sync(client, "s", lambda k, a: "went through") == []
    assert not client.send_user_message("s", f"Went through. (tool call {c2})")
    assert len(_messages(client, "s")) == 5


def test_names_key_matches_whole_keys_only() -> None:
    key = "s/t1/c1"
    assert names_key(f"Note: it went through. (tool call {key})", key)
    assert names_key(f"{key}: done", key) and names_key(f"see {key}.", key)
    assert not names_key("(tool call s/t1/c10)", key)
    assert not names_key("(tool call xs/t1/c1)", key) and not names_key("s/t1/c1-b", key)
    assert not names_key(None, key) and not names_key("", key)


def test_a_sync_form_given_an_async_check_says_which_to_use(store_client: DexClient) -> None:
    _unknown(store_client, "s", "c1", 1)

    async def check(key: str, arguments_json: str) -> str:
        return "went through"

    with pytest.raises(InvalidCheckResultError, match="async report_unknown_outcomes"):
        report_unknown_outcomes_sync(store_client, "s", check)  # type: ignore[arg-type]
    assert _messages(store_client, "s") == []
