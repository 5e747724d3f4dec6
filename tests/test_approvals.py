"""Guarantees 5-7: approvals wait without a worker, the first decision wins, deadlines expire.

Calls that need approval run on real ``dex-tasks worker`` subprocesses with a real Redis and a
real ``dex-tasks beat``; races between deciders are run with threads and with processes, on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import insert, text
from typer.testing import CliRunner

import beat_schedule
import workers.example_tools  # noqa: F401 - registers refund_payment (needs approval) here
from dex_tasks import (
    APPROVAL_DEADLINE_PASSED,
    APPROVAL_REJECTED,
    CallStatus,
    DexClient,
    DexSettings,
    InvalidArgumentError,
    ToolCallRecord,
)
from dex_tasks.agent import approvals
from dex_tasks.broker.routing import queue_for
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.store import INTERRUPTS, Store, deadlines
from dex_tasks.worker import sweeps
from dex_tasks.worker.execution import Runtime
from tests.conftest import StartWorker, fast_settings
from tests.helpers import start_process, user_messages, wait_until
from workers import ledger

StartBeat = Callable[[], "subprocess.Popen[bytes]"]


@pytest.fixture
def db_client(redis_url: str, database_url: str) -> Iterator[DexClient]:
    """A client on SQLite or PostgreSQL (the test runs on both)."""
    with DexClient(fast_settings(redis_url, database_url)) as c:
        yield c


@pytest.fixture
def start_beat(env: dict[str, str], tmp_path: Path) -> Iterator[StartBeat]:
    """Start ``dex-tasks beat`` subprocesses; all are killed at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = start_process(["beat"], env, tmp_path / f"beat-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def refund(client: DexClient, turn: str, call: str, session: str = "s1",
           **kwargs: Any) -> ToolCallRecord:
    """A refund call: a non-idempotent write that waits for approval."""
    record = client.call_tool(session_id=session, turn_id=turn, tool_call_id=call,
                              tool="refund_payment",
                              arguments={"charge_id": f"ch_{call}", "amount_cents": 500},
                              **kwargs)
    assert record.status is CallStatus.AWAITING_APPROVAL
    assert record.interrupt_id is not None
    return record


def interrupt_of(record: ToolCallRecord) -> str:
    assert record.interrupt_id is not None
    return record.interrupt_id


def queue_length(redis_url: str, queue: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.llen(queue))
    finally:
        client.close()


# -- waiting, deciding, running -----------------------------------------------------------------


def test_approval_waits_with_no_message_and_approving_publishes_one(
    client: DexClient, redis_url: str
) -> None:
    # Given a refund awaiting approval, and no worker consuming
    record = refund(client, "t1", "c1")

    # Then no Celery message exists for it, and the snapshot lists it as pending
    assert queue_length(redis_url, queue_for("refund_payment")) == 0
    [pending] = client.get_agent_snapshot("s1").pending_interrupts
    assert (pending.interrupt_id, pending.key, pending.tool) == (
        record.interrupt_id, record.key, "refund_payment")
    assert pending.arguments == {"charge_id": "ch_c1", "amount_cents": 500}
    assert pending.effect.value == "non_idempotent_write"
    assert pending.deadline is None

    # When it is approved, exactly one message is published (the check above can fail)
    assert client.resolve_interrupt("s1", interrupt_of(record), True, approver="alice")
    assert queue_length(redis_url, queue_for("refund_payment")) == 1
    assert client.get_tool_call(record.key).status is CallStatus.QUEUED
    assert client.get_agent_snapshot("s1").pending_interrupts == []


def test_waiting_calls_survive_worker_and_beat_restarts_and_run_once_approved(
    client: DexClient, start_worker: StartWorker, start_beat: StartBeat,
    ledger_path: Path, redis_url: str,
) -> None:
    # Given two refunds of one turn waiting, a third with a short deadline, a message queued
    # behind the open turn, and a worker and beat running
    worker = start_worker(concurrency=2)
    beat = start_beat()
    approved = refund(client, "t1", "c1")
    rejected = refund(client, "t1", "c2")
    expiring = refund(client, "t2", "c1", approval_deadline=1.5)
    assert client.send_user_message("s1", "also refund the shipping")
    assert [m.status for m in user_messages(client.get_agent_snapshot("s1"))] == ["queued"]

    # When the worker and beat are SIGKILLed while the calls wait
    worker.kill_all()
    beat.kill()
    beat.wait(10)
    # Then no message for them is left in Redis (nothing consumes now, so nothing can hide it)
    assert queue_length(redis_url, queue_for("refund_payment")) == 0

    # When a new worker and beat start: beat's deadline sweep rejects the expiring call...
    start_worker(concurrency=2)
    start_beat()
    final = client.wait(expiring.key, timeout=30)
    assert final.status is CallStatus.REJECTED
    assert (final.error or "").startswith(APPROVAL_DEADLINE_PASSED)
    # ...and leaves the calls without a deadline waiting
    for record in (approved, rejected):
        assert client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL

    # When one is rejected and the other approved
    assert client.resolve_interrupt("s1", interrupt_of(rejected), False,
                                    rejection_message="duplicate of c1", approver="bob")
    assert user_messages(client.get_agent_snapshot("s1"))[0].status == "queued"  # c1 open
    assert client.resolve_interrupt("s1", interrupt_of(approved), True, approver="alice")

    # Then the approved one runs once and succeeds; the rejected one never runs
    done = client.wait(approved.key, timeout=30)
    assert done.status is CallStatus.SUCCEEDED
    assert done.result == {"charge_id": "ch_c1", "refunded_cents": 500}
    no = client.get_tool_call(rejected.key)
    assert no.status is CallStatus.REJECTED
    assert no.error == (f"{APPROVAL_REJECTED}: the tool did not run; "
                        "rejected by bob: duplicate of c1")
    runs = ledger.executions(ledger_path)
    assert runs[approved.key] == 1 and rejected.key not in runs and expiring.key not in runs

    # And the turn is over: the message was delivered, and the audit shows every decision
    snapshot = client.get_agent_snapshot("s1")
    [delivered] = user_messages(snapshot)
    assert delivered.status == "delivered" and delivered.delivered_at is not None
    decisions = {d.key: (d.decision, d.decided_by, d.call_status) for d in snapshot.decided}
    assert decisions == {
        expiring.key: ("expired", None, CallStatus.REJECTED),
        rejected.key: ("rejected", "bob", CallStatus.REJECTED),
        approved.key: ("approved", "alice", CallStatus.SUCCEEDED),
    }
    assert snapshot.pending_interrupts == []


# -- the first decision wins --------------------------------------------------------------------


def test_double_resolve_second_returns_false_and_changes_nothing(db_client: DexClient) -> None:
    record = refund(db_client, "t1", "c1")
    assert db_client.resolve_interrupt("s1", interrupt_of(record), True, approver="alice")
    events = db_client.store.events_for_call(record.key)
    before = db_client.get_tool_call(record.key)

    assert not db_client.resolve_interrupt("s1", interrupt_of(record), True, approver="alice")
    assert not db_client.resolve_interrupt("s1", interrupt_of(record), False,
                                           rejection_message="no", approver="bob")

    assert db_client.get_tool_call(record.key) == before
    assert db_client.store.events_for_call(record.key) == events
    [decision] = db_client.get_agent_snapshot("s1").decided
    assert (decision.decision, decision.decided_by) == ("approved", "alice")


def test_queue_expiry_counts_from_the_approval_not_the_request(db_client: DexClient) -> None:
    # Given a call that may wait 30s in the queue, approved an hour after it was requested
    record = refund(db_client, "t1", "c1", expires_in=30)
    approved_at = record.created_at.timestamp() + 3600
    assert approvals.resolve_interrupt(db_client.store, db_client.app, "s1",
                                       interrupt_of(record), True, now=approved_at)
    # Then its 30s start at the approval, so a worker can still run it
    row = db_client.store.get_call(record.key)
    assert row is not None and row.expires_at == pytest.approx(approved_at + 30)


def test_unknown_interrupt_or_wrong_session_returns_false(db_client: DexClient) -> None:
    record = refund(db_client, "t1", "c1")
    refund(db_client, "t1", "c1", session="s2")

    assert not db_client.resolve_interrupt("s2", interrupt_of(record), True)
    assert not db_client.resolve_interrupt("s1", "no-such-interrupt", True)
    # Empty ids are not unknown ones but malformed input: refused, naming the field.
    with pytest.raises(InvalidArgumentError, match="session_id must be a non-empty string"):
        db_client.resolve_interrupt("", "", False)

    assert db_client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL
    assert len(db_client.get_agent_snapshot("s1").pending_interrupts) == 1


def test_malformed_decisions_name_the_field(client: DexClient) -> None:
    record = refund(client, "t1", "c1")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"approved": "yes"}, "approved"),
        ({"approved": True, "approver": 7}, "approver"),
        ({"approved": True, "approver": "x" * 201}, "approver"),
        ({"approved": False, "rejection_message": ["no"]}, "rejection_message"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidArgumentError, match=field):
            client.resolve_interrupt("s1", interrupt_of(record), **kwargs)
    assert client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL


def _check_one_winner(client: DexClient, record: ToolCallRecord,
                      results: dict[int, bool]) -> None:
    """Exactly one decider won, and the stored call and audit say what that one decided."""
    winners = [i for i, won in results.items() if won]
    assert len(results) == 5 and len(winners) == 1, results
    winner = winners[0]
    call = client.get_tool_call(record.key)
    [decision] = client.get_agent_snapshot(record.session_id).decided
    assert decision.decided_by == f"person-{winner}"
    if winner % 2 == 0:
        assert call.status is CallStatus.QUEUED and decision.decision == "approved"
    else:
        assert call.status is CallStatus.REJECTED and decision.decision == "rejected"
        assert call.error is not None and call.error.endswith(f"no from person-{winner}")
    moves = [e for e in client.store.events_for_call(record.key)
             if e.from_status == CallStatus.AWAITING_APPROVAL.value]
    assert len(moves) == 1


def _decide(client: DexClient, record: ToolCallRecord, i: int) -> bool:
    # Even deciders approve, odd ones reject: a wrong winner shows in the final state.
    return client.resolve_interrupt(record.session_id, interrupt_of(record), i % 2 == 0,
                                    rejection_message=f"no from person-{i}",
                                    approver=f"person-{i}")


def test_five_concurrent_resolves_in_threads_have_one_winner(db_client: DexClient) -> None:
    for round_ in range(3):
        record = refund(db_client, f"t{round_}", "c1", session=f"s{round_}")
        barrier = threading.Barrier(5)
        results: dict[int, bool] = {}

        def decide(i: int, record: ToolCallRecord = record,
                   barrier: threading.Barrier = barrier,
                   results: dict[int, bool] = results) -> None:
            barrier.wait()
            results[i] = _decide(db_client, record, i)

        threads = [threading.Thread(target=decide, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        _check_one_winner(db_client, record, results)


def _decide_in_child(redis_url: str, database_url: str, record_json: str, i: int,
                     barrier: Any, out: Any) -> None:
    """Runs in a spawned process: its own client, store connections and Celery app."""
    record = ToolCallRecord.model_validate_json(record_json)
    settings = DexSettings(redis_url=redis_url, database_url=database_url,
                           publish_timeout_seconds=1.0)
    with DexClient(settings, create_tables=False) as client:
        barrier.wait()
        out.put((i, _decide(client, record, i)))


def test_five_concurrent_resolves_in_processes_have_one_winner(
    db_client: DexClient, redis_url: str, database_url: str
) -> None:
    record = refund(db_client, "t1", "c1")
    # forkserver: children fork from one clean server process that imported this module once,
    # so five deciders start in milliseconds and share nothing with pytest's process.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    barrier = ctx.Barrier(5)
    out = ctx.Queue()
    procs = [ctx.Process(target=_decide_in_child,
                         args=(redis_url, database_url, record.model_dump_json(), i, barrier, out))
             for i in range(5)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    _check_one_winner(db_client, record, results)


# -- deadlines ----------------------------------------------------------------------------------


def test_late_approval_is_refused_before_the_sweep_runs(db_client: DexClient) -> None:
    # Given a call whose deadline has just passed, and no sweep yet (2 s: the snapshot below
    # lists only approvals still open, and must be read before the deadline on a busy machine)
    record = refund(db_client, "t1", "c1", approval_deadline=2)
    [pending] = db_client.get_agent_snapshot("s1").pending_interrupts
    assert pending.deadline is not None
    deadline = pending.deadline.timestamp()
    wait_until(lambda: time.time() > deadline, 10, "the deadline to pass")

    # When a person approves it
    # Then the approval is refused and the call still waits for the sweep, off the pending list
    assert not db_client.resolve_interrupt("s1", interrupt_of(record), True, approver="late")
    assert db_client.get_tool_call(record.key).status is CallStatus.AWAITING_APPROVAL
    assert db_client.get_agent_snapshot("s1").pending_interrupts == []

    # When the sweep runs it rejects the call with the deadline reason
    assert deadlines.expire_overdue(db_client.store) == 1
    call = db_client.get_tool_call(record.key)
    assert call.status is CallStatus.REJECTED
    assert call.error is not None and call.error.startswith(APPROVAL_DEADLINE_PASSED)
    assert "deadline" in call.error and "passed" in call.error
    [decision] = db_client.get_agent_snapshot("s1").decided
    assert (decision.decision, decision.decided_by) == ("expired", None)
    # And a second sweep or a late decision changes nothing
    assert deadlines.expire_overdue(db_client.store) == 0
    assert not db_client.resolve_interrupt("s1", interrupt_of(record), False)


def test_deadline_rejection_is_distinct_from_a_human_rejection(db_client: DexClient) -> None:
    by_person = refund(db_client, "t1", "c1", approval_deadline=60)
    by_deadline = refund(db_client, "t1", "c2", approval_deadline=60)
    assert db_client.resolve_interrupt("s1", interrupt_of(by_person), False,
                                       rejection_message="the deadline passed", approver="eve")
    assert deadlines.expire_overdue(db_client.store, now=time.time() + 120) == 1

    person = db_client.get_tool_call(by_person.key).error or ""
    deadline = db_client.get_tool_call(by_deadline.key).error or ""
    # Even a person who writes "the deadline passed" is told apart from the real deadline.
    assert person.startswith(APPROVAL_REJECTED) and not person.startswith(APPROVAL_DEADLINE_PASSED)
    assert deadline.startswith(APPROVAL_DEADLINE_PASSED)
    kinds = {d.key: d.decision for d in db_client.get_agent_snapshot("s1").decided}
    assert kinds == {by_person.key: "rejected", by_deadline.key: "expired"}


def test_two_sweeps_and_a_decider_at_once_decide_each_call_once(db_client: DexClient) -> None:
    # Given 30 calls past their deadline (as the sweeps see time) and a person approving all of
    # them at a time still inside the deadline (as they see it): both sides are legal, so the
    # row guard alone picks the winner of each call
    records = [refund(db_client, "t1", f"c{i}", approval_deadline=60) for i in range(30)]
    later = time.time() + 120
    barrier = threading.Barrier(3)
    swept: list[int] = []
    approved: list[str] = []

    def sweep() -> None:
        barrier.wait()
        swept.append(deadlines.expire_overdue(db_client.store, now=later, batch=7))

    def approve_all() -> None:
        barrier.wait()
        for r in records:
            if approvals.resolve_interrupt(db_client.store, db_client.app, "s1",
                                           interrupt_of(r), True, approver="p"):
                approved.append(r.key)

    threads = [threading.Thread(target=f) for f in (sweep, sweep, approve_all)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    # Then every call was decided exactly once, and its status matches its decision
    assert sum(swept) + len(approved) == len(records)
    decided = {d.key: d.decision for d in db_client.get_agent_snapshot("s1").decided}
    assert len(decided) == len(records)
    for r in records:
        call = db_client.get_tool_call(r.key)
        expected = CallStatus.QUEUED if r.key in approved else CallStatus.REJECTED
        assert call.status is expected
        assert decided[r.key] == ("approved" if r.key in approved else "expired")
        moves = [e for e in db_client.store.events_for_call(r.key)
                 if e.from_status == CallStatus.AWAITING_APPROVAL.value]
        assert len(moves) == 1
    assert deadlines.expire_overdue(db_client.store, now=later) == 0


def test_deadline_sweep_reads_only_overdue_rows_through_the_index(database_url: str) -> None:
    # Given many pending interrupts (deadline ahead), many decided ones, and three overdue,
    # with planner statistics
    store = Store(database_url)
    store.create_all()
    now = time.time()

    def rows(prefix: str, count: int, deadline: float,
             decision: str | None) -> list[dict[str, Any]]:
        return [{"interrupt_id": f"{prefix}{i}", "key": f"s/t/{prefix}{i}", "session_id": "s",
                 "deadline_at": deadline + i, "created_at": now - 60, "decision": decision}
                for i in range(count)]

    with store.write() as conn:
        conn.execute(insert(INTERRUPTS), rows("p", 5000, now + 3600, None)
                     + rows("d", 2000, now - 30, "approved") + rows("o", 3, now - 10, None))
    with store.write() as conn:
        conn.execute(text("ANALYZE"))
        # When the planner is asked how it would run the sweep's statements
        plans = []
        for statement in (deadlines.expire_statement(now), deadlines.batch_bound(now, 500)):
            sql = str(statement.compile(conn, compile_kwargs={"literal_binds": True}))
            explain = "EXPLAIN QUERY PLAN" if store.is_sqlite else "EXPLAIN"
            plans.append("\n".join(str(r[-1]) for r in conn.exec_driver_sql(f"{explain} {sql}")))
    store.close()
    # Then each reaches the overdue rows through the (decision, deadline_at) index with both
    # bounds, and neither scans the table nor walks the pending rows
    for plan in plans:
        assert "ix_dex_interrupts_open_deadline" in plan, plan
        assert "SCAN dex_interrupts\n" not in plan + "\n" and "Seq Scan" not in plan, plan
        if store.is_sqlite:
            assert "ix_dex_interrupts_open_deadline (decision=? AND deadline_at<?)" in plan, plan
        else:
            conds = [line for line in plan.splitlines() if "Cond" in line]
            assert conds and all("deadline_at <" in line for line in conds), plan


def test_sweep_run_all_includes_the_deadline_and_message_jobs(client: DexClient,
                                                               rt: Runtime) -> None:
    # `dex-tasks sweep` and beat_schedule.py both run every job of sweeps.JOBS
    record = refund(client, "t1", "c1", approval_deadline=60)
    client.send_user_message("s1", "waiting on the refund")
    counts = sweeps.run_all(rt, now=time.time() + 120)
    assert counts["expire_approvals"] == 1
    assert counts["deliver_messages"] == 0  # the expiry itself delivered the message
    assert client.get_tool_call(record.key).status is CallStatus.REJECTED
    assert [m.status for m in user_messages(client.get_agent_snapshot("s1"))] == ["delivered"]
    assert {"dex.expire_approvals", "dex.deliver_messages"} <= set(
        beat_schedule.build(client.settings))


# -- the command line ---------------------------------------------------------------------------


def test_cli_lists_approves_and_rejects(client: DexClient, env: dict[str, str]) -> None:
    first = refund(client, "t1", "c1")
    second = refund(client, "t1", "c2")
    runner = CliRunner()

    listed = runner.invoke(cli_app, ["approvals", "list", "s1"], env=env)
    assert listed.exit_code == 0, listed.output
    assert interrupt_of(first) in listed.output and interrupt_of(second) in listed.output

    ok = runner.invoke(cli_app, ["approvals", "approve", "s1", interrupt_of(first),
                                 "--approver", "ops"], env=env)
    assert ok.exit_code == 0, ok.output
    assert "decided: approved" in ok.output
    again = runner.invoke(cli_app, ["approvals", "reject", "s1", interrupt_of(first)], env=env)
    assert again.exit_code == 1 and "already approved by ops" in again.output

    no = runner.invoke(cli_app, ["approvals", "reject", "s1", interrupt_of(second),
                                 "--message", "not needed"], env=env)
    assert no.exit_code == 0, no.output
    call = client.get_tool_call(second.key)
    assert call.status is CallStatus.REJECTED
    assert call.error is not None and call.error.endswith(": not needed")
    assert "rejected by cli:" in call.error

    empty = runner.invoke(cli_app, ["approvals", "list", "s1", "--json"], env=env)
    assert empty.exit_code == 0 and empty.output.strip() == "[]"
