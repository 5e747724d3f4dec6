"""``dex-tasks prune``: old finished calls go with their events, interrupts and transcript rows,
a batch per transaction; what reconciliation or an open turn still needs stays; workers keep
running calls meanwhile. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from typer.testing import CliRunner

from dex_tasks import CallStatus, DexClient, InvalidArgumentError, MessageRole
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.store import CALLS, EVENTS, INTERRUPTS, MESSAGES, Store
from dex_tasks.store.prune import PruneResult, candidates, parse_age, prune
from dex_tasks.store.transcript import add_assistant_message, report_text, send_user_message
from dex_tasks.worker.reconcilers import unreported_calls
from tests.conftest import StartWorker, fast_settings
from tests.helpers import open_store

NOW = time.time()
DAY = 86400.0
OLD = NOW - 40 * DAY


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    with open_store(database_url) as s:
        yield s


def add_call(store: Store, key: str, end: CallStatus | None, *, at: float = OLD,
             interrupt: bool = False) -> str:
    """A call requested at ``at`` and (if ``end``) ended a second later, through the store's
    own transitions, so it has the events, interrupt and tool message a real one has."""
    session, turn, call = key.split("/")
    needs_approval = interrupt or end is CallStatus.REJECTED
    row = {
        "key": key, "session_id": session, "turn_id": turn, "tool_call_id": call,
        "tool": "charge_card", "arguments": '{"amount_cents":5}',
        "effect": "non_idempotent_write", "requires_approval": needs_approval,
        "max_attempts": 1, "time_limit": None,
        "status": (CallStatus.AWAITING_APPROVAL if needs_approval else CallStatus.QUEUED).value,
        "attempts": 0, "published_at": at, "created_at": at, "updated_at": at,
        "interrupt_id": f"i-{turn}-{call}" if needs_approval else None,
    }
    assert store.insert_call(row, {
        "interrupt_id": row["interrupt_id"], "key": key, "session_id": session,
        "deadline_at": None, "created_at": at} if needs_approval else None)
    if end is CallStatus.REJECTED:
        assert store.transition(key, end, values={"error": "no"}, now=at + 1)
    elif end is not None:
        assert store.transition(key, CallStatus.RUNNING, now=at)
        values = {"result": '{"ok":true}'} if end is CallStatus.SUCCEEDED else {"error": "x"}
        assert store.transition(key, end, values=values, now=at + 1)
    return key


def count(store: Store, table: Any, *where: Any) -> int:
    with store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(table).where(*where))
                   .scalar_one())


def keys(store: Store) -> set[str]:
    with store.read() as conn:
        return set(conn.execute(select(CALLS.c.key)).scalars())


def test_ages_are_days_hours_or_minutes_and_a_bad_one_names_the_option() -> None:
    assert (parse_age("30d"), parse_age("12h"), parse_age("90m")) == (30 * DAY, 12 * 3600.0,
                                                                     90 * 60.0)
    for bad in ("30", "1.5d", "-3d", "0d", "3w", "d", ""):
        with pytest.raises(InvalidArgumentError, match="older_than must be a whole number"):
            parse_age(bad)
    result = CliRunner().invoke(cli_app, ["prune", "--older-than", "30 days"])
    assert result.exit_code == 2
    assert "Invalid value for '--older-than'" in result.output
    assert "30d, 12h or 90m" in result.output and "'30 days'" in result.output


def test_prune_deletes_old_finished_calls_and_keeps_what_is_still_needed(store: Store) -> None:
    # Given, in an idle session: old calls of each terminal status (one rejected with its
    # interrupt), an old unknown outcome that was reported and one that was not, a recent
    # call, and old and recent user and assistant messages
    gone = [add_call(store, f"idle/t{i}/c1", CallStatus.SUCCEEDED) for i in range(5)]
    gone += [add_call(store, "idle/tf/c1", CallStatus.FAILED),
             add_call(store, "idle/tr/c1", CallStatus.REJECTED),
             add_call(store, "idle/tu/c1", CallStatus.OUTCOME_UNKNOWN)]
    unreported = add_call(store, "idle/tu/c2", CallStatus.OUTCOME_UNKNOWN)
    recent = add_call(store, "idle/tn/c1", CallStatus.SUCCEEDED, at=NOW - DAY)
    assert send_user_message(store, "idle", "hello", now=OLD + 5)
    assert send_user_message(store, "idle", report_text("idle/tu/c1", "it went through"),
                             now=OLD + 6)
    add_assistant_message(store, "idle", "t0", "Your order shipped.", now=OLD + 7)
    assert send_user_message(store, "idle", "thanks", now=NOW - DAY)
    # And, in a session waiting on an approval: an old ended call of the waiting turn, an
    # old ended call of an earlier turn, and old messages (one queued behind the turn)
    old_turn = add_call(store, "busy/t0/c1", CallStatus.SUCCEEDED)
    same_turn = add_call(store, "busy/t1/c1", CallStatus.SUCCEEDED)
    waiting = add_call(store, "busy/t1/c2", None, at=OLD + 10, interrupt=True)
    assert send_user_message(store, "busy", "early", now=OLD + 2)
    queued = send_user_message(store, "busy", "while you wait", now=OLD + 20)
    assert queued is not None and queued.status == "queued"
    events_gone = count(store, EVENTS, EVENTS.c.key.in_([*gone, old_turn]))

    # When prune runs with a 30-day cutoff, two calls or messages per transaction
    result = prune(store, 30 * DAY, batch=2, now=NOW)

    # Then the old ended calls went, with every event, interrupt and tool message of theirs
    assert keys(store) == {unreported, recent, same_turn, waiting}
    assert (result.calls, result.events) == (len(gone) + 1, events_gone)
    assert result.interrupts == 1 and result.tool_messages == len(gone) + 1
    assert count(store, EVENTS, EVENTS.c.key.in_([*gone, old_turn])) == 0
    assert count(store, INTERRUPTS, INTERRUPTS.c.key == "idle/tr/c1") == 0
    assert count(store, MESSAGES, MESSAGES.c.key.in_([*gone, old_turn])) == 0
    # And the unknown outcome no one has reported stays (reconciliation needs it), with its
    # tool message; so does the ended call of the turn still waiting
    assert (result.kept_unreported, result.kept_open_turn) == (1, 1)
    assert [c.key for c in unreported_calls(store)] == [unreported]
    assert count(store, MESSAGES, MESSAGES.c.key == unreported) == 1
    # And the idle session's old user and assistant messages went; the busy session's stay
    with store.read() as conn:
        texts = dict(conn.execute(select(MESSAGES.c.text, MESSAGES.c.session_id)
                                  .where(MESSAGES.c.role != MessageRole.TOOL.value)).all())
    assert texts == {"thanks": "idle", "early": "busy", "while you wait": "busy"}
    assert result.messages == 3
    # And no transaction held more than two calls or messages
    assert result.batches >= (len(gone) + 1) // 2 + 2

    # When it runs again, nothing more goes
    again = prune(store, 30 * DAY, batch=2, now=NOW)
    assert (again.calls, again.messages, again.kept_unreported) == (0, 0, 1)
    # And once the turn ends and the unknown outcome is reported, those go too
    assert store.transition(waiting, CallStatus.REJECTED, values={"error": "no"}, now=OLD + 30)
    assert send_user_message(store, "idle", report_text(unreported, "it did not go through"),
                             now=NOW)
    last = prune(store, 30 * DAY, batch=2, now=NOW)
    assert keys(store) == {recent}
    assert (last.calls, last.kept_unreported, last.kept_open_turn) == (3, 0, 0)
    assert last.messages == 2  # the busy session's, now that it waits for nothing


def test_a_report_of_a_kept_unknown_outcome_is_kept(store: Store) -> None:
    # Given an unknown outcome that finished recently, and an old user message that names it
    # (the user had asked about that call before it ended)
    key = add_call(store, "s/t1/c1", CallStatus.OUTCOME_UNKNOWN, at=NOW - DAY)
    assert send_user_message(store, "s", f"what happened to {key}?", now=OLD)
    # When prune runs, the message stays: without it the call would look unreported
    result = prune(store, 30 * DAY, now=NOW)
    assert result.messages == 0
    assert list(unreported_calls(store)) == []


def _old_calls(store: Store, n: int) -> None:
    """``n`` calls that succeeded 40 days ago, each with two events and a tool message."""
    rows, events, messages = [], [], []
    for i in range(n):
        key = f"old{i % 50}/t{i}/c1"
        rows.append({
            "key": key, "session_id": f"old{i % 50}", "turn_id": f"t{i}", "tool_call_id": "c1",
            "tool": "lookup_order", "arguments": '{"order_id":"1"}', "effect": "read",
            "requires_approval": False, "max_attempts": 3, "time_limit": None,
            "status": "succeeded", "prev_status": "running", "result": '{"ok":true}',
            "error": None, "attempts": 1, "interrupt_id": None, "worker": None,
            "lease_expires_at": None, "published_at": OLD, "republishes": 0,
            "expires_at": None, "created_at": OLD, "updated_at": OLD, "finished_at": OLD + i,
        })
        for to in ("queued", "succeeded"):
            events.append({"session_id": f"old{i % 50}", "key": key, "event": "x",
                           "from_status": None, "to_status": to, "detail": None,
                           "created_at": OLD})
        messages.append({"session_id": f"old{i % 50}", "role": "tool", "text": None,
                         "status": None, "created_at": OLD + i, "delivered_at": None,
                         "turn_id": f"t{i}", "tool_call_id": "c1", "tool": "lookup_order",
                         "key": key, "call_status": "succeeded",
                         "tool_arguments": '{"order_id":"1"}', "tool_output": '{"ok":true}'})
    with store.write() as conn:
        conn.execute(insert(CALLS), rows)
        conn.execute(insert(EVENTS), events)
        conn.execute(insert(MESSAGES), messages)


def test_prune_reads_old_calls_through_the_status_finished_index(store: Store) -> None:
    # Given many recent calls and a few old ones, with planner statistics
    _old_calls(store, 30)
    recent = [{"key": f"new/t{i}/c1", "session_id": "new", "turn_id": f"t{i}",
               "tool_call_id": "c1", "tool": "lookup_order", "arguments": "{}", "effect": "read",
               "requires_approval": False, "max_attempts": 3, "status": status,
               "attempts": 1, "republishes": 0, "created_at": NOW, "updated_at": NOW,
               "finished_at": NOW if status != "running" else None}
              for i, status in enumerate(["succeeded", "failed", "running"] * 3000)]
    with store.write() as conn:
        conn.execute(insert(CALLS), recent)
    with store.write() as conn:
        conn.exec_driver_sql("ANALYZE")
        # When the planner is asked how prune reads a page of candidates (a later page too)
        plans = []
        for after in (None, (OLD + 5, "old5/t5/c1")):
            statement = candidates("succeeded", NOW - 30 * DAY, after, 1000)
            sql = str(statement.compile(conn, compile_kwargs={"literal_binds": True}))
            explain = "EXPLAIN QUERY PLAN" if store.is_sqlite else "EXPLAIN"
            plans.append("\n".join(str(r[-1]) for r in conn.exec_driver_sql(f"{explain} {sql}")))
    # Then it walks the (status, finished_at) index from the start of the status's range:
    # O(old calls), not O(calls)
    for plan in plans:
        assert "ix_dex_calls_status_finished" in plan, plan
        assert "Seq Scan" not in plan and "SCAN dex_tool_calls\n" not in plan + "\n", plan
        if store.is_sqlite:
            assert "(status=? AND finished_at" in plan, plan
        else:
            conds = [line for line in plan.splitlines() if "Index Cond" in line]
            assert conds and "finished_at <" in conds[0], plan


def test_workers_keep_running_calls_while_prune_runs(
    database_url: str, redis_url: str, start_worker: StartWorker
) -> None:
    # Given 3,000 calls that ended 40 days ago, and a worker on the same store
    settings = fast_settings(redis_url, database_url)
    start_worker(extra_env={"DEX_DATABASE_URL": database_url})
    with DexClient(settings) as client:
        _old_calls(client.store, 3000)
        # (A first call warms the worker and the client, so that what is timed against prune
        # below is calls, not a cold start: prune took about as long as one cold call did
        # on a loaded machine, and the test failed with no call beside it.)
        warm = client.call_tool(session_id="live", turn_id="warm", tool_call_id="c1",
                                tool="lookup_order", arguments={"order_id": "1001"})
        assert client.wait(warm.key, timeout=30).status is CallStatus.SUCCEEDED
        # When prune runs, 10 calls a transaction, while the agent keeps calling tools
        done: list[PruneResult] = []

        def run_prune() -> None:
            own = Store(database_url)  # as `dex-tasks prune` would: a process of its own
            try:
                done.append(prune(own, 30 * DAY, batch=10))
            finally:
                own.close()

        pruner = threading.Thread(target=run_prune)
        pruner.start()
        finished, during, slowest = [], 0, 0.0
        while pruner.is_alive() or len(finished) < 5:
            started = time.monotonic()
            record = client.call_tool(session_id="live", turn_id=f"t{len(finished)}",
                                      tool_call_id="c1", tool="lookup_order",
                                      arguments={"order_id": "1001"})
            # Then every call still runs to the end
            finished.append(client.wait(record.key, timeout=30))
            slowest = max(slowest, time.monotonic() - started)
            during += pruner.is_alive()
        pruner.join(120)
    assert all(r.status is CallStatus.SUCCEEDED for r in finished)
    assert during >= 3, "prune ended before calls could run beside it"
    # And prune deleted every old call, 10 at a time
    result = done[0]
    assert (result.calls, result.events, result.tool_messages) == (3000, 6000, 3000)
    assert result.batches == 300
    # (Figures for the report.)
    print(f"\nprune: {result.calls} calls in {result.batches} transactions, the longest "
          f"{result.longest_batch_seconds * 1000:.0f} ms; {during} calls ran to the end "
          f"meanwhile, the slowest in {slowest * 1000:.0f} ms")
