"""The store on SQLite and PostgreSQL: the guarded transition, events, inserts, the catalog.

Every test runs on both engines (the ``database_url`` fixture). Concurrency is real: threads
with their own connections, and separate processes each with its own ``Store``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text

from dex_tasks import CallStatus, IllegalTransitionError, StoreUnavailableError
from dex_tasks.states import ALLOWED_FROM, TERMINAL
from dex_tasks.store import CALLS, Move, Store
from tests.helpers import open_store, race_in_processes


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    with open_store(database_url) as s:
        yield s


def call_row(key: str, status: CallStatus = CallStatus.QUEUED, **over: Any) -> dict[str, Any]:
    """A complete call row as ``DexClient`` would insert it."""
    session, turn, call = key.split("/")
    now = time.time()
    row: dict[str, Any] = {
        "key": key, "session_id": session, "turn_id": turn, "tool_call_id": call,
        "tool": "charge_card", "arguments": '{"amount_cents":5}',
        "effect": "non_idempotent_write", "requires_approval": False, "max_attempts": 1,
        "time_limit": None, "status": status.value, "attempts": 0, "published_at": now,
        "created_at": now, "updated_at": now,
    }
    row.update(over)
    return row


def _claim(store: Store, key: str, owner: str) -> bool:
    return store.transition(key, CallStatus.RUNNING, allowed={CallStatus.QUEUED},
                            where=[CALLS.c.attempts == 0],
                            values={"attempts": 1, "worker": owner})


# -- the guarded transition ----------------------------------------------------------------------


def test_transition_writes_the_event_with_from_and_to_status(store: Store) -> None:
    assert store.insert_call(call_row("s/t/c"))
    assert _claim(store, "s/t/c", "w:1")
    assert store.transition("s/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                            values={"result": "42"}, detail={"why": "done"}, now=1000.0)
    row = store.get_call("s/t/c")
    assert row is not None
    assert (row.status, row.result, row.attempts, row.worker) == ("succeeded", "42", 1, "w:1")
    assert row.finished_at == 1000.0 and row.lease_expires_at is None
    events = [(e.event, e.from_status, e.to_status) for e in store.events_for_call("s/t/c")]
    assert events == [
        ("tool_call_requested", None, "queued"),
        ("tool_call_started", "queued", "running"),
        ("tool_call_finished", "running", "succeeded"),
    ]
    last = store.events_for_call("s/t/c")[-1]
    # JSON compared as JSON: jsonb (PostgreSQL) hands back its own spelling of the text.
    assert json.loads(last.detail or "") == {"why": "done"} and last.created_at == 1000.0
    assert [e.key for e in store.events("s")] == ["s/t/c"] * 3


def test_transition_and_its_event_commit_or_roll_back_together(store: Store) -> None:
    store.insert_call(call_row("s/t/c"))
    # Given an outer transaction that changes the status and then fails
    with pytest.raises(RuntimeError), store.write() as conn:
        assert store.transition("s/t/c", CallStatus.RUNNING, conn=conn)
        raise RuntimeError("boom")
    # Then neither the status nor the event survived
    assert store.get_call("s/t/c").status == "queued"  # type: ignore[union-attr]
    assert len(store.events_for_call("s/t/c")) == 1

    # Given the event cannot be written at all
    with store.write() as conn:
        conn.execute(text("DROP TABLE dex_call_events"))
    # When a transition is attempted, it fails and the status change is rolled back with it
    with pytest.raises(StoreUnavailableError):
        store.transition("s/t/c", CallStatus.RUNNING)
    assert store.get_call("s/t/c").status == "queued"  # type: ignore[union-attr]


def test_illegal_moves_raise_and_change_nothing(store: Store) -> None:
    store.insert_call(call_row("s/t/c"))
    with pytest.raises(IllegalTransitionError, match=r"succeeded.*awaiting_approval"):
        store.transition("s/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.AWAITING_APPROVAL})
    with pytest.raises(IllegalTransitionError, match="awaiting_approval"):
        store.transition("s/t/c", CallStatus.AWAITING_APPROVAL)
    with pytest.raises(IllegalTransitionError):
        store.transition("s/t/c", CallStatus.RUNNING, allowed=set())
    # A legal move from a status the call is not in is refused by the guard, not an error.
    assert not store.transition("s/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING})
    assert not store.transition("s/t/no-such-call", CallStatus.RUNNING)
    assert store.get_call("s/t/c").status == "queued"  # type: ignore[union-attr]
    assert len(store.events_for_call("s/t/c")) == 1


@pytest.mark.parametrize("final", sorted(TERMINAL, key=lambda s: s.value))
def test_terminal_records_never_change(store: Store, final: CallStatus) -> None:
    start = next(iter(ALLOWED_FROM[final]))
    store.insert_call(call_row("s/t/c", start))
    assert store.transition("s/t/c", final, values={"error": "the end"})
    before = store.get_call("s/t/c")
    # No status, terminal ones included, accepts a move away from a terminal status...
    for target in CallStatus:
        assert not (ALLOWED_FROM[target] & TERMINAL)
        if ALLOWED_FROM[target]:
            assert not store.transition("s/t/c", target, values={"error": "rewritten"})
    # ...and the non-status writers leave terminal rows alone too.
    store.mark_published("s/t/c", now=1.0)
    assert store.renew_leases("", ["s/t/c"], seconds=100) == 0
    assert store.get_call("s/t/c") == before
    assert len(store.events_for_call("s/t/c")) == 2


def test_extra_guards_decide_the_owner(store: Store) -> None:
    store.insert_call(call_row("s/t/c"))
    assert _claim(store, "s/t/c", "w:1")
    # A stale owner (a killed child, an earlier attempt) cannot finish someone else's call.
    assert not store.transition("s/t/c", CallStatus.SUCCEEDED, where=[CALLS.c.worker == "w:2"])
    assert store.transition("s/t/c", CallStatus.SUCCEEDED, where=[CALLS.c.worker == "w:1"])


def test_only_one_of_many_threads_wins_each_claim(store: Store) -> None:
    keys = [f"s/t/c{i}" for i in range(20)]
    for key in keys:
        store.insert_call(call_row(key))
    # Given 8 threads racing to claim every call at the same moment
    start = threading.Barrier(8)

    def contender(n: int) -> list[str]:
        start.wait()
        return [key for key in keys if _claim(store, key, f"w:{n}")]

    with ThreadPoolExecutor(8) as pool:
        won = [key for result in pool.map(contender, range(8)) for key in result]
    # Then every call was won exactly once, and each has exactly one start event
    assert sorted(won) == sorted(keys)
    for key in keys:
        starts = [e for e in store.events_for_call(key) if e.to_status == "running"]
        assert len(starts) == 1


def _process_contender(url: str, keys: list[str], name: str, go: Any, out: Any) -> None:
    store = Store(url)
    go.wait(30)
    out.put((name, [key for key in keys if _claim(store, key, name)]))
    store.close()


def test_only_one_of_several_processes_wins_each_claim(store: Store) -> None:
    keys = [f"s/t/p{i}" for i in range(40)]
    for key in keys:
        store.insert_call(call_row(key))
    # Given 4 processes, each with its own Store, racing over the same calls
    results = dict(race_in_processes(
        _process_contender, [(store.url, keys, f"proc{i}:1") for i in range(4)]))
    # Then each call was claimed by exactly one process, the one its row names
    won = [key for keys_won in results.values() for key in keys_won]
    assert sorted(won) == sorted(keys)
    for name, keys_won in results.items():
        for key in keys_won:
            assert store.get_call(key).worker == name  # type: ignore[union-attr]


# -- inserts, leases and the catalog -----------------------------------------------------------


def test_insert_call_race_on_the_same_key_has_one_winner(store: Store) -> None:
    start = threading.Barrier(6)

    def insert(n: int) -> bool:
        start.wait()
        return store.insert_call(call_row("s/t/same", arguments=f'{{"n":{n}}}'))

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(insert, range(6)))
    assert results.count(True) == 1
    winner = results.index(True)
    assert store.get_call("s/t/same").arguments == f'{{"n":{winner}}}'  # type: ignore[union-attr]
    assert len(store.events_for_call("s/t/same")) == 1


def test_leases_renew_only_for_the_owning_worker_on_the_stores_clock(store: Store) -> None:
    store.insert_call(call_row("s/t/a"))
    store.insert_call(call_row("s/t/b"))
    _claim(store, "s/t/a", "node1@h:11")
    _claim(store, "s/t/b", "node2@h:22")
    before = store.store_time()
    assert store.renew_leases("node1@h:", ["s/t/a", "s/t/b"], seconds=100.0) == 1
    lease = store.get_call("s/t/a").lease_expires_at  # type: ignore[union-attr]
    assert lease is not None and before + 100 <= lease <= store.store_time() + 100
    assert store.get_call("s/t/b").lease_expires_at is None  # type: ignore[union-attr]
    # A lease that ran out five seconds ago, by the store's clock
    store.renew_leases("node2@h:", ["s/t/b"], seconds=-5.0)
    assert [c.key for c in store.expired_leases()] == ["s/t/b"]
    assert sorted(c.key for c in store.expired_leases(now=lease + 1)) == ["s/t/a", "s/t/b"]


def test_stranded_queued_selects_old_or_never_published(store: Store) -> None:
    store.insert_call(call_row("s/t/old", published_at=10.0))
    store.insert_call(call_row("s/t/new", published_at=100.0))
    store.insert_call(call_row("s/t/never", published_at=None))
    store.insert_call(call_row("s/t/held", CallStatus.AWAITING_APPROVAL, published_at=None))
    assert sorted(c.key for c in store.stranded_queued(50.0)) == ["s/t/never", "s/t/old"]
    store.mark_published("s/t/old", now=60.0)
    assert [c.key for c in store.stranded_queued(50.0)] == ["s/t/never"]


def test_catalog_upsert(store: Store) -> None:
    entry = {"name": "t1", "policy": '{"effect":"read"}', "hints": None,
             "arguments_schema": "{}", "description": "first", "updated_at": 1.0}
    assert store.publish_catalog([entry]) == 1
    assert store.publish_catalog([{**entry, "description": "second", "updated_at": 2.0},
                                  {**entry, "name": "t2"}]) == 2
    row = store.get_catalog("t1")
    assert row is not None and (row.description, row.updated_at) == ("second", 2.0)
    assert store.get_catalog("t2") is not None
    assert store.get_catalog("missing") is None


def test_concurrent_catalog_publishes_of_a_new_tool_all_succeed(store: Store) -> None:
    from dex_tasks.store import catalog
    from workers import example_tools

    # Given several workers starting at once, all publishing the same new tools
    start = threading.Barrier(4)

    def publish(_: int) -> int:
        start.wait()
        return catalog.publish(store, [example_tools.lookup_order, example_tools.charge_card])

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(publish, range(4))) == [2, 2, 2, 2]
    assert store.get_catalog("charge_card") is not None


def test_unreachable_store_raises_store_unavailable_without_the_password() -> None:
    store = Store("postgresql+psycopg://dex:hunter2@127.0.0.1:1/nope?connect_timeout=2")
    with pytest.raises(StoreUnavailableError) as err:
        store.get_call("s/t/c")
    assert "hunter2" not in str(err.value)
    assert "127.0.0.1:1" in str(err.value)


def test_a_child_forked_while_a_thread_writes_can_still_write(sqlite_url: str) -> None:
    # Given a SQLite store and a thread inside a write transaction (a worker's lease renewer)
    store = Store(sqlite_url)
    store.create_all()
    store.insert_call(call_row("s/t/c"))
    in_tx = threading.Event()

    def renewer() -> None:
        with store.write() as conn:
            conn.execute(CALLS.update().values(updated_at=1.0))
            in_tx.set()
            # Hold the transaction open long enough for the fork below to land inside it.
            time.sleep(0.3)

    thread = threading.Thread(target=renewer)
    thread.start()
    in_tx.wait(10)
    # When the process forks (billiard replacing a child) while that transaction is open
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, on purpose
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), timeout=3,
                                   isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE dex_tool_calls SET updated_at = 2.0")
            conn.execute("COMMIT")
            code = 0
        finally:
            os._exit(code)
    thread.join(10)
    # Then the child can write: it did not inherit a lock it does not hold
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert store.get_call("s/t/c").updated_at == 2.0  # type: ignore[union-attr]


# -- the claim, set-based transitions, and what a call costs -----------------------------------


def test_claim_returns_the_call_and_a_refusal_rolls_it_back(store: Store) -> None:
    store.insert_call(call_row("s/t/c"))
    # A claim whose checks refuse the call leaves it queued, untouched. SQLite rolls the claim
    # back (no event); PostgreSQL's one-statement claim has committed when the checks run, and
    # its guarded move back says so in the history.
    with pytest.raises(LookupError, match="no tool"):
        store.claim("s/t/c", "w@h:1", 30.0, lambda row: (_ for _ in ()).throw(
            LookupError("no tool")))
    row = store.get_call("s/t/c")
    assert row is not None and (row.status, row.attempts, row.worker) == ("queued", 0, None)
    assert row.lease_expires_at is None
    refused = ["running", "queued"] if store.is_postgres else []
    events = store.events_for_call("s/t/c")
    assert [e.to_status for e in events] == ["queued", *refused]
    if store.is_postgres:
        assert '"claim_refused"' in (events[-1].detail or "")
    # A claim that passes returns the whole row as claimed, its lease on the store's clock
    before = store.store_time()
    claimed = store.claim("s/t/c", "w@h:1", 30.0, lambda row: row.tool)
    assert claimed is not None
    claimed_row, vetted = claimed
    assert vetted == "charge_card"
    assert (claimed_row.status, claimed_row.attempts, claimed_row.worker) == (
        "running", 1, "w@h:1")
    assert claimed_row.arguments == '{"amount_cents":5}'
    assert before + 30 <= claimed_row.lease_expires_at <= store.store_time() + 30
    # A second delivery finds nothing to claim
    assert store.claim("s/t/c", "w@h:2", 30.0, lambda row: None) is None
    assert [e.to_status for e in store.events_for_call("s/t/c")] == [
        "queued", *refused, "running"]


def test_transition_many_guards_each_call_and_writes_one_event_each(store: Store) -> None:
    keys = [f"s/t/c{i}" for i in range(5)]
    for key in keys:
        store.insert_call(call_row(key))
        assert _claim(store, key, "w:1")
    store.insert_call(call_row("s/t/queued"))
    # Given moves to two targets, each with its own guard and values; c4's guard is stale and
    # the queued call is not running
    moves = [
        Move(keys[0], CallStatus.QUEUED, match={"worker": "w:1", "attempts": 1},
             values={"worker": None, "published_at": 10.0}, detail={"n": 0}),
        Move(keys[1], CallStatus.QUEUED, match={"worker": "w:1", "attempts": 1},
             values={"worker": None, "published_at": 11.0}, detail={"n": 1}),
        Move(keys[2], CallStatus.OUTCOME_UNKNOWN, match={"worker": "w:1"},
             values={"error": "lost two"}),
        Move(keys[3], CallStatus.OUTCOME_UNKNOWN, match={"worker": "w:1"},
             values={"error": "lost three"}),
        Move(keys[4], CallStatus.OUTCOME_UNKNOWN, match={"worker": "w:9"},
             values={"error": "not mine"}),
        Move("s/t/queued", CallStatus.OUTCOME_UNKNOWN, values={"error": "not running"}),
    ]
    with pytest.raises(IllegalTransitionError, match="from awaiting_approval"):
        store.transition_many(moves, allowed={CallStatus.AWAITING_APPROVAL})
    # When they are made in one set-based transition
    moved = store.transition_many(moves, allowed={CallStatus.RUNNING}, now=500.0)
    # Then exactly the calls whose guards held moved, each with its own values and one event
    assert moved == set(keys[:4])
    rows = {key: store.get_call(key) for key in [*keys, "s/t/queued"]}
    assert [(rows[k].status, rows[k].published_at, rows[k].worker)  # type: ignore[union-attr]
            for k in keys[:2]] == [("queued", 10.0, None), ("queued", 11.0, None)]
    assert [(rows[k].status, rows[k].error, rows[k].finished_at)  # type: ignore[union-attr]
            for k in keys[2:4]] == [("outcome_unknown", "lost two", 500.0),
                                    ("outcome_unknown", "lost three", 500.0)]
    assert rows[keys[4]].status == "running"  # type: ignore[union-attr]
    assert rows["s/t/queued"].status == "queued"  # type: ignore[union-attr]
    for key in keys[:4]:
        last = store.events_for_call(key)[-1]
        assert (last.from_status, last.created_at) == ("running", 500.0)
        assert len(store.events_for_call(key)) == 3
    assert json.loads(store.events_for_call(keys[1])[-1].detail or 'null') == {"n": 1}
    assert len(store.events_for_call(keys[4])) == 2


def test_set_based_endings_deliver_the_messages_of_turns_they_end(store: Store) -> None:
    from dex_tasks.store.transcript import send_user_message

    # Given two sessions whose turns are open, each with a user message waiting
    for session in ("s1", "s2"):
        store.insert_call(call_row(f"{session}/t/c"))
        assert _claim(store, f"{session}/t/c", "w:1")
        sent = send_user_message(store, session, "hello")
        assert sent is not None and sent.status == "queued"
    # When one set-based transition ends both turns' last calls
    assert store.transition_many(
        [Move(f"{s}/t/c", CallStatus.OUTCOME_UNKNOWN, values={"error": "lost"})
         for s in ("s1", "s2")], allowed={CallStatus.RUNNING}) == {"s1/t/c", "s2/t/c"}
    # Then both messages were delivered in that transaction
    with store.read() as conn:
        statuses = conn.execute(text(
            "SELECT status FROM dex_messages WHERE role = 'user'")).scalars().all()
    assert statuses == ["delivered", "delivered"]
    # and each call that ended got its one tool message in the transcript
    with store.read() as conn:
        tool_messages = conn.execute(text(
            "SELECT key, call_status FROM dex_messages WHERE role = 'tool' ORDER BY key")).all()
    assert [tuple(m) for m in tool_messages] == [("s1/t/c", "outcome_unknown"),
                                                 ("s2/t/c", "outcome_unknown")]


def test_a_call_costs_a_worker_two_writes_and_delivery_only_when_a_message_waits(
    store: Store,
) -> None:
    from sqlalchemy import event

    from dex_tasks.store.transcript import send_user_message

    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        verb = statement.split(None, 1)[0].upper()
        if verb == "WITH":  # one statement of data-modifying CTEs (PostgreSQL)
            statements.append("WITH " + " ".join(
                f"{v} {t}" for v, t in re.findall(r"\b(INSERT INTO|UPDATE) (\w+)", statement)))
        elif verb in ("SELECT", "INSERT", "UPDATE", "DELETE"):
            statements.append(f"{verb} {_table(statement)}")

    def committed(_conn: Any) -> None:
        statements.append("COMMIT")

    def traced(statement: str) -> None:
        # What reaches SQLite itself: the hot path's statements are sent on the DB-API
        # connection (store/driver.py), where SQLAlchemy's execute events do not see them.
        if statement.split(None, 1)[0].upper() == "COMMIT":
            committed(None)
        else:
            seen(None, None, statement)

    def trace_sqlite(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(traced)

    def run_call(key: str) -> list[str]:
        statements.clear()
        assert store.claim(key, "w@h:1", 30.0, lambda row: None) is not None
        assert store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                                match={"worker": "w@h:1"}, values={"result": "1"})
        return list(statements)

    store.insert_call(call_row("s1/t/c"))
    store.insert_call(call_row("s2/t/c"))
    sent = send_user_message(store, "s2", "while the turn runs")
    assert sent is not None and sent.status == "queued"
    if store.is_sqlite:
        store.close()  # new connections (none held, none pooled), traced from their start
        event.listen(store.engine, "connect", trace_sqlite)
    else:
        event.listen(store.engine, "before_cursor_execute", seen)
        event.listen(store.engine, "commit", committed)
    try:
        # A call of a session with no message waiting: claim (UPDATE ... RETURNING, its event)
        # and finish (UPDATE ... RETURNING, its event, which says no message waits)
        plain = run_call("s1/t/c")
        # A call whose session has a message waiting: the delivery statement runs too
        waiting = run_call("s2/t/c")
    finally:
        if store.is_sqlite:
            event.remove(store.engine, "connect", trace_sqlite)
            store.close()
        else:
            event.remove(store.engine, "before_cursor_execute", seen)
            event.remove(store.engine, "commit", committed)
    if store.is_postgres:
        # One statement each, in autocommit (one round trip, no COMMIT of their own); the
        # delivery, when a message waits, in a transaction of its own
        claim = ["WITH UPDATE dex_tool_calls INSERT INTO dex_call_events"]
        finish = ["WITH UPDATE dex_tool_calls INSERT INTO dex_call_events "
                  "INSERT INTO dex_messages"]
        assert plain == [*claim, *finish]
        assert waiting == [*claim, *finish, "SELECT ", "UPDATE dex_messages", "COMMIT"]
        return
    claim = ["UPDATE dex_tool_calls", "INSERT dex_call_events", "COMMIT"]
    finish = ["UPDATE dex_tool_calls", "INSERT dex_messages", "INSERT dex_call_events"]
    assert plain == [*claim, *finish, "COMMIT"]
    assert waiting == [*claim, *finish, "UPDATE dex_messages", "COMMIT"]


def test_a_calls_end_is_announced_only_after_the_messages_it_released_are_delivered(
    store: Store,
) -> None:
    from dex_tasks.store.transcript import send_user_message, session_messages

    # Given a running call whose session has a user message waiting for its turn to end,
    # and a hook that reads the session when the call's end is announced (as a waiter does)
    store.insert_call(call_row("s1/t/c"))
    assert send_user_message(store, "s1", "and the shipping") is not None
    seen: list[list[str | None]] = []

    def announced(_ended: Any) -> None:
        with store.read() as conn:
            seen.append([m.status for m in session_messages(conn, "s1")
                         if m.role.value == "user"])

    store.on_calls_ended(announced)
    assert store.claim("s1/t/c", "w@h:1", 30.0, lambda row: None) is not None
    # When the call ends (one statement on PostgreSQL, the delivery in a transaction of its
    # own), then the announcement came after the delivery: the waiter reads it delivered
    assert store.transition("s1/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                            match={"worker": "w@h:1"}, values={"result": "1"})
    assert seen == [["delivered"]]


def test_set_based_statements_find_their_calls_by_key_among_many_in_one_status(
    store: Store,
) -> None:
    # Given 3,000 calls in each of the statuses the sweeps and renewals look at (the sweep
    # benchmark had a million pending approvals); PostgreSQL with the statistics autovacuum
    # keeps, SQLite as it is deployed, without any (nothing runs ANALYZE on it)
    now = time.time()
    rows = [call_row(f"s/{status.value}/c{i}", status, worker="w@h:1", lease_expires_at=now)
            for status in (CallStatus.AWAITING_APPROVAL, CallStatus.RUNNING, CallStatus.QUEUED)
            for i in range(3000)]
    with store.write() as conn:
        conn.execute(CALLS.insert(), rows)
        if not store.is_sqlite:
            conn.execute(text("ANALYZE"))

    def keys(status: CallStatus) -> list[str]:
        return [f"s/{status.value}/c{i}" for i in (7, 1500, 2999)]

    with _statements(store.engine, "UPDATE DEX_TOOL_CALLS") as seen:
        # When a sweep moves a few of them (each with its own values and guards), a worker
        # renews its leases and the republisher marks messages sent
        rejected = store.transition_many(
            [Move(k, CallStatus.REJECTED, values={"error": f"late {k}"})
             for k in keys(CallStatus.AWAITING_APPROVAL)],
            allowed={CallStatus.AWAITING_APPROVAL})
        reaped = store.transition_many(
            [Move(k, CallStatus.OUTCOME_UNKNOWN, match={"worker": "w@h:1", "attempts": 0},
                  values={"error": "lost"}) for k in keys(CallStatus.RUNNING)[:2]],
            allowed={CallStatus.RUNNING})
        renewed = store.renew_leases("w@h:", keys(CallStatus.RUNNING), 30.0)
        store.mark_published(keys(CallStatus.QUEUED), republished=True)
    assert rejected == set(keys(CallStatus.AWAITING_APPROVAL))
    assert reaped == set(keys(CallStatus.RUNNING)[:2]) and renewed == 1
    assert len(seen) == 4

    # Then each UPDATE reaches its calls through the key, never by walking a status's calls
    # (on SQLite that read all 1M pending approvals per sweep: 16 s instead of 0.1 s)
    for plan in _plans(store, seen):
        assert "ix_dex_calls_status" not in plan and "Seq Scan" not in plan, plan
        assert "(key=?)" in plan if store.is_sqlite else "dex_tool_calls_pkey" in plan, plan


def test_the_stranded_call_read_is_index_ranges_not_a_walk_of_the_queue(store: Store) -> None:
    # Given 3,000 queued calls published just now, none stranded, and a few that are: two
    # never published and two published long ago
    now = time.time()
    rows = [call_row(f"s/q/c{i}", published_at=now) for i in range(3000)]
    rows += [call_row(f"s/never/c{i}", published_at=None) for i in range(2)]
    rows += [call_row(f"s/old/c{i}", published_at=now - 3600 + i) for i in range(2)]
    with store.write() as conn:
        conn.execute(CALLS.insert(), rows)
        if not store.is_sqlite:
            conn.execute(text("ANALYZE"))
    # When the republisher asks for the stranded ones
    with _statements(store.read_engine, "SELECT") as seen:
        stranded = [c.key for c in store.stranded_queued(now - 60)]
    # Then it gets the never published first and then the oldest, within its limit
    assert sorted(stranded[:2]) == ["s/never/c0", "s/never/c1"]
    assert stranded[2:] == ["s/old/c0", "s/old/c1"]
    assert [c.key for c in store.stranded_queued(now - 60, limit=3)] == stranded[:3]
    # and each read is a range of the (status, published_at) index, bounded on both columns,
    # never a walk of every queued call filtered row by row
    plans = _plans(store, seen)
    assert len(plans) == 2
    for plan in plans:
        assert "ix_dex_calls_status_published" in plan and "Seq Scan" not in plan, plan
        if store.is_sqlite:
            assert "(status=? AND published_at" in plan, plan
        else:
            assert "Filter" not in plan, plan
            assert all("published_at" in line for line in plan.splitlines() if "Cond" in line)


@contextmanager
def _statements(engine: Any, prefix: str) -> Iterator[list[tuple[str, Any]]]:
    """The statements (with their parameters) ``engine`` runs that start with ``prefix``."""
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(prefix):
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", capture)


def _plans(store: Store, statements: list[tuple[str, Any]]) -> list[str]:
    """The planner's plan of each statement, as it would run with its parameters."""
    explain = "EXPLAIN QUERY PLAN" if store.is_sqlite else "EXPLAIN"
    with store.read() as conn:
        return ["\n".join(str(r[-1] if store.is_sqlite else r[0])
                          for r in conn.exec_driver_sql(f"{explain} {sql}", params))
                for sql, params in statements]


def _table(statement: str) -> str:
    words = statement.replace("\n", " ").split()
    for marker in ("UPDATE", "INTO", "FROM"):
        if marker in words:
            return words[words.index(marker) + 1].strip('"')
    return ""


def _create_schema(url: str, go: Any, out: Any) -> None:
    store = Store(url)
    go.wait(30)
    try:
        store.create_all()
        out.put("created")
    except Exception as err:  # noqa: BLE001 - reported to the test
        out.put(f"{type(err).__name__}: {err}")
    store.close()


def test_a_new_sqlite_file_opens_while_another_process_holds_its_write_lock(
    tmp_path: Any,
) -> None:
    # Given a new SQLite file whose write lock another connection holds, as a process that
    # starts at the same moment does while it converts the file to WAL
    path = tmp_path / "new.db"
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        holding.set()
        release.wait(30)
        conn.execute("COMMIT")
        conn.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    # When this process opens it, and the lock is let go half a second later
    started = time.monotonic()
    threading.Timer(0.5, release.set).start()
    store = Store(f"sqlite:///{path}")
    try:
        store.create_all()
        waited = time.monotonic() - started
        # Then it waited for the lock instead of failing ("database is locked" at once), and
        # the file is in WAL mode with a working schema
        assert waited >= 0.4
        with store.read() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert store.insert_call(call_row("s/t/c"))
    finally:
        release.set()
        holder.join(10)
        store.close()


def test_schema_creation_is_safe_from_several_processes_at_once(database_url: str) -> None:
    # Given a fresh, empty database and six processes starting at the same moment
    ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
    go = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_create_schema, args=(database_url, go, out)) for _ in range(6)]
    for proc in procs:
        proc.start()
    # When they all create the schema
    go.set()
    results = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(30)
    # Then all of them succeed, and the schema works
    assert results == ["created"] * 6
    store = Store(database_url)
    assert store.insert_call(call_row("s/t/c"))
    store.close()


def test_publish_marks_are_written_off_the_callers_path_in_few_updates(
    store: Store, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dex_tasks.store import leases

    # Given marks that wait longer than this test takes for the marks that follow them (so
    # that the outcome does not depend on the machine's speed)
    monkeypatch.setattr(leases, "MARKS_LINGER_SECONDS", 30.0)
    keys = [f"s/t/m{i}" for i in range(60)]
    with _statements(store.engine, "UPDATE DEX_TOOL_CALLS") as seen:
        # When 60 calls are recorded with no publish time and each is marked published as its
        # message leaves, one after another, as call_tool does
        before = time.time()
        for key in keys:
            assert store.insert_call(call_row(key, published_at=None))
            store.mark_published_soon([key])
        # Then closing the store writes them at once: every call has its publish time, all
        # in one UPDATE (the thread used to write one per wake, nearly one per call)
        started = time.monotonic()
        store.close()
        assert time.monotonic() - started < 10.0  # a flush does not wait out the linger
    rows = store.get_calls(keys)
    assert all(before <= (rows[k].published_at or 0) <= time.time() for k in keys)
    assert len(seen) == 1


def test_a_claim_refuses_a_call_expired_in_the_queue_or_with_no_attempt_left(
    store: Store,
) -> None:
    # Given a call that expired in the queue, one whose attempts were all used (its workers
    # were lost), and one that may run
    now = time.time()
    assert store.insert_call(call_row("s/t/expired", expires_at=now - 1))
    assert store.insert_call(call_row("s/t/used", effect="read", max_attempts=2, attempts=2))
    assert store.insert_call(call_row("s/t/ok", expires_at=now + 60))
    vetted: list[str] = []
    # When a worker claims each
    claims = {key: store.claim(key, "w@h:1", 30.0, lambda row: vetted.append(row.key), now=now)
              for key in ("s/t/expired", "s/t/used", "s/t/ok")}
    # Then only the one that may run is claimed; the others were never claimed (nothing to
    # undo, no check ran on them) and stay queued as they were, for the worker to end
    assert [k for k, c in claims.items() if c is not None] == ["s/t/ok"] == vetted
    for key, attempts in (("s/t/expired", 0), ("s/t/used", 2)):
        call = store.get_call(key)
        assert call is not None
        assert (call.status, call.attempts, call.worker) == ("queued", attempts, None)
        assert [e.event for e in store.events_for_call(key)] == ["tool_call_requested"]


def test_a_late_publish_mark_never_moves_a_later_publish_time_back(store: Store) -> None:
    # Given a call whose first message's mark is still on its way (call_tool's, written by
    # the store's thread), and which a worker has meanwhile tried and scheduled a retry of,
    # due 4 s from now (the retry's message carries that time)
    sent = time.time()
    assert store.insert_call(call_row("s/t/r", published_at=None, effect="read",
                                      max_attempts=3))
    assert store.claim("s/t/r", "w@h:1", 30.0, lambda row: None) is not None
    assert store.transition("s/t/r", CallStatus.QUEUED, allowed={CallStatus.RUNNING},
                            values={"published_at": sent + 4.0, "worker": None})
    # When the first message's mark lands, late
    store.mark_published(["s/t/r"], sent)
    # Then the call keeps the retry's time: the republisher does not take it for stranded
    call = store.get_call("s/t/r")
    assert call is not None and call.published_at == sent + 4.0
    # And a republish (later than both) still records its time
    store.mark_published(["s/t/r"], sent + 10.0, republished=True)
    call = store.get_call("s/t/r")
    assert call is not None and (call.published_at, call.republishes) == (sent + 10.0, 1)


@pytest.fixture
def postgres_store(postgres_url: str) -> Iterator[Store]:
    """A store on a fresh PostgreSQL database, for what only PostgreSQL does."""
    with open_store(postgres_url) as s:
        yield s


def test_publish_marks_of_any_number_of_calls_are_one_statement_on_postgres(
    postgres_store: Store,
) -> None:
    # PostgreSQL's marks bind their keys as one array (SQLite's list them: its statements are
    # not prepared on a server)
    store = postgres_store
    # Given queued calls recorded with no publish time
    keys = [f"s/t/p{i}" for i in range(4)]
    for key in keys:
        assert store.insert_call(call_row(key, published_at=None))
    with _statements(store.engine, "UPDATE DEX_TOOL_CALLS SET PUBLISHED_AT") as seen:
        # When one, then three of them are marked published, as the marks thread writes them
        store.mark_published(keys[:1], 10.0)
        store.mark_published(keys[1:], 20.0)
    # Then both writes are the same statement text (compiled once, prepared once on the
    # server: an IN list was a new text for each number of keys, compiled on every write)
    assert len(seen) == 2 and seen[0][0] == seen[1][0]
    # and each call has its mark
    rows = store.get_calls(keys)
    assert [rows[k].published_at for k in keys] == [10.0, 20.0, 20.0, 20.0]


def test_a_publish_mark_lands_within_the_linger_without_a_flush(store: Store) -> None:
    from dex_tasks.store.calls import UNSENT_GRACE_SECONDS
    from dex_tasks.store.leases import MARKS_LINGER_SECONDS

    # Given a call recorded with no publish time
    assert store.insert_call(call_row("s/t/m", published_at=None))
    # When it is marked published and nothing flushes the marks
    store.mark_published_soon(["s/t/m"])
    # Then its mark lands by itself, long before anyone would take it for a call never sent
    assert MARKS_LINGER_SECONDS <= UNSENT_GRACE_SECONDS / 4
    deadline = time.monotonic() + UNSENT_GRACE_SECONDS
    while (call := store.get_call("s/t/m")) is not None and call.published_at is None:
        assert time.monotonic() < deadline, "the mark did not land within the grace period"
        time.sleep(0.01)


def test_a_call_that_ends_soon_after_it_is_sent_gets_no_publish_mark_written(
    store: Store,
) -> None:
    # A quick call ends within a few milliseconds; this one takes 0.1 s end to end (20 times
    # a no-op call's, made alone): its mark must still find it ended, and so write nothing
    # (on PostgreSQL a mark that writes is a new row version in every index of the call).
    run_for = 0.1
    for attempt in range(5):
        key = f"s/t/quick{attempt}"
        # Given a call recorded with no publish time, then marked published as it is sent
        assert store.insert_call(call_row(key, published_at=None, effect="read",
                                          max_attempts=3))
        with _statements(store.engine, "UPDATE DEX_TOOL_CALLS SET PUBLISHED_AT") as marks:
            sent = time.monotonic()
            store.mark_published_soon([key])
            # When the call ends 0.1 s later, as a worker ends it
            time.sleep(run_for)
            assert store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                                    values={"result": "null", "attempts": 1})
            ended_after = time.monotonic() - sent
            # and the marks thread writes the mark by itself
            deadline = time.monotonic() + 5.0
            while not marks:
                assert time.monotonic() < deadline, "the mark was never written"
                time.sleep(0.01)
        if ended_after > 3 * run_for:
            continue  # this machine stalled: the call did not end as soon as the story says
        # Then the mark found the call ended: its row is as the ending left it
        call = store.get_call(key)
        assert call is not None and call.status == "succeeded"
        assert call.published_at is None
        return
    pytest.fail("the machine stalled through every attempt")
