"""Reconciliation of ``outcome_unknown`` calls: reports reach the session once, and only once."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

import workers.example_tools  # noqa: F401 - registers charge_card and its reconciler here too
from dex_tasks import CallStatus, DexClient, tool
from dex_tasks.celery_app import SWEEP
from dex_tasks.execution import Runtime
from dex_tasks.reconcile import (
    InvalidCheckResultError,
    reconcile_with_reconcilers,
)
from dex_tasks.reconcile import report_unknown_outcomes_sync as report_unknown_outcomes
from dex_tasks.registry import ToolContext
from dex_tasks.states import OUTCOME_UNKNOWN_TOOL_RESULT
from dex_tasks.store import MESSAGES
from dex_tasks.sweeps import run_job
from tests.conftest import StartWorker, fast_settings
from tests.helpers import ROOT, dex_command, user_messages, wait_until
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

    reports = report_unknown_outcomes(client, "s1", check)

    # Then c1's answer is sent into the session, naming the key; c2 waits for an answer
    assert reports == [f"Note from the payment system: charge 1 went through. (tool call {c1})"]
    assert sorted(k for k, _ in asked) == [c1, c2]
    assert '"amount_cents":100' in dict(asked)[c1]
    assert _messages(client, "s1") == reports
    # ... and running it again sends nothing new and does not ask about c1 again
    asked.clear()
    assert report_unknown_outcomes(client, "s1", check) == []
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
    assert report_unknown_outcomes(client, "s1", lambda k, a: "again") == []
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


def test_two_reconcilers_racing_report_each_call_once(store_client: DexClient) -> None:
    client = store_client
    keys = [_unknown(client, "race", f"c{i}", 100 + i) for i in range(3)]
    # Both runs are inside check() for the same key before either records anything.
    barrier = threading.Barrier(2, timeout=20)

    def check(key: str, arguments_json: str) -> str:
        barrier.wait()
        return f"Note from the bank: {arguments_json} settled."

    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(report_unknown_outcomes(client, "race", check))
        except BaseException as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    # Then each key was reported exactly once between the two runs
    sent = sorted(r for result in results for r in result)
    assert len(sent) == 3
    assert sorted(_messages(client, "race")) == sent
    for key in keys:
        assert sum(key in text for text in sent) == 1
    assert _report_count(client) == 3


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
        report_unknown_outcomes(client, "s", lambda key, args: 42)  # type: ignore[arg-type]
