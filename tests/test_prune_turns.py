"""``dex-tasks prune`` and durable turns (issue 28, items 7 and 8).

* An open turn's journal is never pruned: prune keyed on open *calls*, so an agent killed after
  its charge ended and before the model read the result lost its journaled step to a prune
  (the call had ended, nothing else of the turn was open); restarted, it asked the model again,
  whose new call id made a new key, and the card was charged a second time. Shown with a real
  Pydantic AI agent process and a real worker.
* Ended turns, and the LangGraph checkpoints of threads whose session has nothing open, are
  pruned by the same ``--older-than`` (they used to stay for ever); an open turn, a thread
  whose session waits for a call, and the newest checkpoint of a thread still in use stay.

SQLite and PostgreSQL for the store-level stories.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from dex_tasks import CallStatus, DexClient
from dex_tasks.integrations.langchain import DexCheckpointer
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.store import CALLS, MESSAGES, Store
from dex_tasks.store.prune import prune
from dex_tasks.store.tables import TURNS
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.test_durable_turns_pydantic_ai import CHARGE, AgentProcess
from workers import example_tools, ledger

DAY = 86400.0


def test_an_open_turns_journal_survives_prune_and_the_restarted_agent_charges_once(
    client: DexClient, start_worker: StartWorker, env: dict[str, str], ledger_path: Path,
    tmp_path: Path,
) -> None:
    start_worker(concurrency=2)
    session, model_log = "s-pruned", tmp_path / "model.jsonl"
    # Given an agent killed after its charge ended and before the model read the result
    first = AgentProcess(env, session, "charge_card", CHARGE, model_log, "after_tool",
                         tmp_path / "first.out")
    first.proc.wait(90)
    assert first.proc.returncode == -signal.SIGKILL, first.output()
    [charge] = client.get_agent_snapshot(session).tool_calls
    assert charge.status is CallStatus.SUCCEEDED and client.open_turn(session) is not None

    # When prune runs as if 40 days had passed (the turn still open)
    prune(client.store, 30 * DAY, now=time.time() + 40 * DAY)
    turn = client.open_turn(session)
    assert turn is not None and [s.step for s in turn.steps] == [0]
    assert [c.key for c in turn.steps[0].calls] == [charge.key]

    # And the agent is started again, the plain way
    second = AgentProcess(env, session, "charge_card", CHARGE, model_log, "none",
                          tmp_path / "second.out")
    second.proc.wait(90)
    assert second.proc.returncode == 0, second.output()

    # Then the card was charged once, and the model made its first decision once: the step
    # was replayed from the journal, under the same key
    assert ledger.executions(ledger_path) == {charge.key: 1}
    answered = [e["step"] for e in ledger.read(model_log) if e["event"] == "answered"]
    assert sorted(answered) == [0, 1]
    assert json.loads(second.output())["output"].startswith("done: ")
    assert client.open_turn(session) is None


# -- the store ---------------------------------------------------------------------------------


@pytest.fixture
def dex(redis_url: str, database_url: str) -> Iterator[DexClient]:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        yield client


def step_call(turn: str, call: str = "c1") -> dict[str, Any]:
    return {"tool_call_id": call, "tool": "lookup_order", "arguments": {"order_id": turn}}


def end_calls(store: Store, session: str) -> None:
    """Every call of the session run and ended through the store's own transitions (as a
    worker would, with their events and tool messages): the test is about what prune keeps."""
    with store.read() as conn:
        keys = list(conn.execute(select(CALLS.c.key).where(CALLS.c.session_id == session))
                    .scalars())
    for key in keys:
        assert store.transition(key, CallStatus.RUNNING)
        assert store.transition(key, CallStatus.SUCCEEDED, values={"result": '{"ok":1}'})


def turns(store: Store) -> set[tuple[str, str]]:
    with store.read() as conn:
        return {(r.session_id, r.turn_id) for r in conn.execute(
            select(TURNS.c.session_id, TURNS.c.turn_id))}


def messages_of(store: Store, session: str) -> int:
    with store.read() as conn:
        return len(conn.execute(select(MESSAGES.c.id).where(
            MESSAGES.c.session_id == session)).all())


def test_ended_turns_go_and_an_open_turn_keeps_its_journal(dex: DexClient) -> None:
    store = dex.store
    # Given a session whose turn ended (a step, its call, the answer) and a session whose
    # turn is still open with a step whose call has ended
    done = dex.begin_turn("done", "Where is order 1?")
    dex.record_step("done", done.turn_id, 0, '{"r": 0}', [step_call("1")])
    end_calls(store, "done")
    dex.end_turn("done", done.turn_id, "It shipped.")
    open_ = dex.begin_turn("open", "Where is order 2?")
    dex.record_step("open", open_.turn_id, 0, '{"r": 0}', [step_call("2")])
    end_calls(store, "open")
    recent = dex.begin_turn("recent", "Where is order 3?")
    dex.end_turn("recent", recent.turn_id, "Tomorrow.")

    # When prune runs 40 days later, for the first two (the third ended "yesterday")
    later = time.time() + 40 * DAY
    with store.write() as conn:
        conn.execute(TURNS.update().where(TURNS.c.session_id == "recent").values(
            ended_at=later - DAY))
    result = prune(store, 30 * DAY, now=later)

    # Then the ended turn went with its call and its messages
    assert turns(store) == {("open", open_.turn_id), ("recent", recent.turn_id)}
    assert result.turns == 1
    assert dex.store.get_call(f"done/{done.turn_id}/c1") is None
    assert messages_of(store, "done") == 0
    # And the open turn kept its step, its call and the messages the model reads
    turn = dex.open_turn("open")
    assert turn is not None and [s.step for s in turn.steps] == [0]
    assert [c.tool_call_id for c in turn.steps[0].calls] == ["c1"]
    assert messages_of(store, "open") == 3  # the input, the step, the tool message
    assert result.kept_open_turn == 1

    # Once that turn ends, it goes the same way
    dex.end_turn("open", open_.turn_id, "It is on its way.")
    again = prune(store, 30 * DAY, now=later + 2 * DAY)
    assert turns(store) == {("recent", recent.turn_id)}
    assert (again.turns, again.calls) == (1, 1) and messages_of(store, "open") == 0


def put(saver: DexCheckpointer, thread: str, n: int, ns: str = "") -> None:
    """``n`` checkpoints of a thread, each the parent of the next."""
    from langgraph.checkpoint.base import empty_checkpoint

    config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
    for i in range(n):
        checkpoint = {**empty_checkpoint(), "channel_values": {"i": i}}
        config = saver.put(config, checkpoint, {"source": "loop", "step": i}, {})
        saver.put_writes(config, [("i", i)], f"task-{i}")


def age_checkpoints(store: Store, thread: str, at: float, newest_at: float | None = None,
                    ) -> None:
    from dex_tasks.store.checkpoints import CHECKPOINTS

    with store.write() as conn:
        conn.execute(CHECKPOINTS.update().where(CHECKPOINTS.c.thread_id == thread)
                     .values(created_at=at))
        if newest_at is not None:
            newest = conn.execute(select(CHECKPOINTS.c.checkpoint_id)
                                  .where(CHECKPOINTS.c.thread_id == thread)
                                  .order_by(CHECKPOINTS.c.checkpoint_id.desc())).first()
            assert newest is not None
            conn.execute(CHECKPOINTS.update().where(
                CHECKPOINTS.c.thread_id == thread,
                CHECKPOINTS.c.checkpoint_id == newest.checkpoint_id).values(created_at=newest_at))


def test_checkpoints_of_threads_with_nothing_open_are_pruned(dex: DexClient) -> None:
    assert example_tools.refund_payment  # its policy: a person approves each refund
    store, saver = dex.store, DexCheckpointer(dex)
    now = time.time()
    old = now - 40 * DAY
    # Given an idle thread (every checkpoint 40 days old; its session has nothing open), one
    # whose session waits for an approval, one in use (its newest checkpoint is recent), and
    # one whose session's id is the thread id escaped (a "/" in it)
    for thread in ("idle", "waiting", "in-use", "team/7"):
        put(saver, thread, 3)
        put(saver, thread, 2, ns="child:1")
    for thread in ("idle", "waiting", "team/7"):
        age_checkpoints(store, thread, old)
    age_checkpoints(store, "in-use", old, newest_at=now)
    dex.call_tool(session_id="waiting", turn_id="t", tool_call_id="c", tool="refund_payment",
                  arguments={"charge_id": "ch_1", "amount_cents": 5})
    dex.call_tool(session_id="team~2f7", turn_id="t", tool_call_id="c", tool="refund_payment",
                  arguments={"charge_id": "ch_2", "amount_cents": 5})

    # When prune runs with a 30-day cutoff
    result = prune(store, 30 * DAY, now=now)

    def count(thread: str, ns: str | None = None) -> int:
        config: Any = {"configurable": {"thread_id": thread}}
        if ns is not None:
            config["configurable"]["checkpoint_ns"] = ns
        return len(list(saver.list(config)))

    # Then the idle thread is gone, checkpoints and writes; the threads whose session waits
    # for a call are whole; the thread in use lost its old super-steps, each namespace
    # keeping its newest
    assert count("idle") == 0
    assert (count("waiting"), count("team/7")) == (5, 5)
    assert (count("in-use", ""), count("in-use", "child:1")) == (1, 1)
    assert (result.checkpoints, result.checkpoint_writes) == (5 + 3, 5 + 3)
    newest = saver.get_tuple({"configurable": {"thread_id": "in-use"}})
    assert newest is not None and newest.checkpoint["channel_values"] == {"i": 2}
    assert [w[2] for w in newest.pending_writes or []] == [2]

    # And once the approval is decided, the waiting thread goes too
    for session in ("waiting", "team~2f7"):
        [pending] = dex.get_agent_snapshot(session).pending_interrupts
        assert dex.resolve_interrupt(session, pending.interrupt_id, False)
    assert prune(store, 30 * DAY, now=now).checkpoints == 10
    assert count("waiting") == 0 and count("team/7") == 0


def test_the_command_says_what_it_pruned(settings: Any) -> None:
    with DexClient(settings) as client:
        turn = client.begin_turn("s", "hi")
        client.end_turn("s", turn.turn_id, "hello")
        put(DexCheckpointer(client), "thread", 2)
        with client.store.write() as conn:
            conn.execute(TURNS.update().values(ended_at=time.time() - 40 * DAY))
        age_checkpoints(client.store, "thread", time.time() - 40 * DAY)
    done = CliRunner().invoke(cli_app, ["prune", "--older-than", "30d"],
                              env=settings_env(settings))
    assert done.exit_code == 0, done.output
    assert "1 ended turns" in done.output and "2 LangGraph checkpoints" in done.output


def test_prune_finds_old_turns_and_checkpoints_through_their_indexes(dex: DexClient) -> None:
    from sqlalchemy import insert

    from dex_tasks.store.checkpoints import CHECKPOINTS
    from dex_tasks.store.prune import checkpoint_candidates, turn_candidates

    # Given many recent turns and checkpoints and a few old ones, with planner statistics
    store, now = dex.store, time.time()
    old = now - 40 * DAY
    turn_rows = [{"session_id": f"s{i % 50}", "turn_id": f"t{i}", "input": "x",
                  "status": "ended" if i % 3 else "open", "created_at": now,
                  "ended_at": (old if i < 20 else now) if i % 3 else None}
                 for i in range(3000)]
    checkpoint_rows = [{"thread_id": f"th{i % 300}", "checkpoint_ns": "",
                        "checkpoint_id": f"{i:08d}", "parent_checkpoint_id": None,
                        "type": "msgpack", "checkpoint": b"\x80", "metadata": "{}",
                        "created_at": old if i < 20 else now} for i in range(3000)]
    with store.write() as conn:
        conn.execute(insert(TURNS), turn_rows)
        conn.execute(insert(CHECKPOINTS), checkpoint_rows)
    with store.write() as conn:
        conn.exec_driver_sql("ANALYZE")
        # When the planner is asked how prune reads a page of each (a later page too)
        plans = {}
        for name, statement, index in (
            ("turns", turn_candidates(now - 30 * DAY, None, 1000), "ix_dex_turns_status_ended"),
            ("turns, later", turn_candidates(now - 30 * DAY, (old, "s1", "t1"), 1000),
             "ix_dex_turns_status_ended"),
            ("checkpoints", checkpoint_candidates(now - 30 * DAY, None, 1000),
             "ix_dex_checkpoints_created"),
            ("checkpoints, later", checkpoint_candidates(now - 30 * DAY, (old, "th1", "", "1"),
                                                         1000), "ix_dex_checkpoints_created"),
        ):
            sql = str(statement.compile(conn, compile_kwargs={"literal_binds": True}))
            explain = "EXPLAIN QUERY PLAN" if store.is_sqlite else "EXPLAIN"
            plans[name] = (index, "\n".join(
                str(r[-1]) for r in conn.exec_driver_sql(f"{explain} {sql}")))
    # Then each walks its index's range of old rows: O(old rows), not O(rows)
    for name, (index, plan) in plans.items():
        assert index in plan, (name, plan)
        assert "Seq Scan" not in plan, (name, plan)
