"""Durable turns in the core: begin_turn, record_step (the journal, in the calls' transaction),
end_turn (queued user messages delivered after the turn), open_turn (one read), and a call
recorded but never sent, which the next request of its key and the republisher send."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from dex_tasks import (
    CallStatus,
    DexClient,
    DexSettings,
    InvalidArgumentError,
    MessageRole,
    TurnConflictError,
)
from dex_tasks.store.calls import UNSENT_GRACE_SECONDS
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import republish_stranded
from tests.conftest import fast_settings, settings_env
from tests.helpers import ROOT, WorkerProcess, start_process, wait_until
from workers import ledger

S = "s-durable"
LOOKUP = {"tool_call_id": "c1", "tool": "lookup_order", "arguments": {"order_id": "1001"}}
CHARGE = {"tool_call_id": "c2", "tool": "charge_card",
          "arguments": {"customer_id": "cu_1", "amount_cents": 500}}
RESPONSE = json.dumps({"parts": [{"tool_name": "lookup_order", "tool_call_id": "c1"}]})


@pytest.fixture
def store_settings(redis_url: str, database_url: str) -> DexSettings:
    return fast_settings(redis_url, database_url)


@pytest.fixture
def dex(store_settings: DexSettings) -> Iterator[DexClient]:
    with DexClient(store_settings) as c:
        yield c


def _worker(settings: DexSettings, ledger_path: Path, tmp_path: Path) -> WorkerProcess:
    proc = start_process(["worker", "--tools", "workers.example_tools", "-c", "2"],
                         settings_env(settings, ledger_path), tmp_path / "worker.log")
    return WorkerProcess(proc, tmp_path / "worker.log").wait_ready()


def test_a_turn_begins_once_and_a_restart_finds_it_open_with_its_steps(dex: DexClient) -> None:
    # Given a turn begun with an input and one journaled step
    turn = dex.begin_turn(S, "Where is order 1001?")
    assert (turn.status, turn.resumed, turn.queued_input, turn.steps) == ("open", False, False,
                                                                          [])
    records = dex.record_step(S, turn.turn_id, 0, RESPONSE, [LOOKUP], text="Looking it up.")
    assert [r.key for r in records] == [f"{S}/{turn.turn_id}/c1"]

    # When the agent process restarts and begins the same input again
    again = dex.begin_turn(S, "Where is order 1001?")

    # Then it continues the open turn, its journaled step and that step's call in hand
    assert (again.turn_id, again.resumed, again.next_step) == (turn.turn_id, True, 1)
    step = again.step(0)
    assert step is not None and json.loads(step.response) == json.loads(RESPONSE)
    assert step.text == "Looking it up."
    assert [c.key for c in step.calls] == [records[0].key]
    assert dex.open_turn(S) == again.model_copy(update={"resumed": False})
    # And the transcript holds the input once, and the step as an assistant message with calls
    messages = dex.get_agent_snapshot(S).messages
    assert [(m.role, m.text) for m in messages] == [
        (MessageRole.USER, "Where is order 1001?"), (MessageRole.ASSISTANT, "Looking it up.")]
    assert messages[1].step == 0
    assert messages[1].tool_calls == [{"tool_call_id": "c1", "tool": "lookup_order",
                                       "arguments": {"order_id": "1001"}}]


def test_recording_a_step_again_returns_its_calls_and_another_response_conflicts(
    dex: DexClient,
) -> None:
    turn = dex.begin_turn(S, "charge me")
    first = dex.record_step(S, turn.turn_id, 0, RESPONSE, [LOOKUP, CHARGE])
    # The replay of the step: the same records, nothing new
    again = dex.record_step(S, turn.turn_id, 0, RESPONSE, [LOOKUP, CHARGE])
    assert [(r.key, r.created_at) for r in again] == [(r.key, r.created_at) for r in first]
    assert len(dex.get_agent_snapshot(S).tool_calls) == 2
    # Another response for step 0: refused, naming the step, nothing written
    other = json.dumps({"parts": [{"tool_name": "charge_card"}]})
    with pytest.raises(TurnConflictError, match=rf"{S}/{turn.turn_id}#0.*model response"):
        dex.record_step(S, turn.turn_id, 0, other, [CHARGE])
    with pytest.raises(TurnConflictError, match="list of tool calls"):
        dex.record_step(S, turn.turn_id, 0, RESPONSE, [LOOKUP])
    # A step that skips one is refused; step 1 is the next
    with pytest.raises(InvalidArgumentError, match="the next one is step 1"):
        dex.record_step(S, turn.turn_id, 2, RESPONSE, [])
    with pytest.raises(InvalidArgumentError, match="response must be JSON text"):
        dex.record_step(S, turn.turn_id, 1, "{not json", [])
    with pytest.raises(InvalidArgumentError, match="step must be an int"):
        dex.record_step(S, turn.turn_id, -1, RESPONSE, [])
    # A step with no dex-tasks call is journaled too (the response is what a replay needs)
    assert dex.record_step(S, turn.turn_id, 1, json.dumps({"text": "hm"}), []) == []
    opened = dex.open_turn(S)
    assert opened is not None and [len(s.calls) for s in opened.steps] == [2, 0]
    assert len(dex.get_agent_snapshot(S).tool_calls) == 2


def test_add_assistant_message_ends_a_durable_turn_and_only_that(dex: DexClient) -> None:
    turn = dex.begin_turn(S, "hello", turn_id="t-durable")
    dex.record_step(S, "t-durable", 0, RESPONSE, [])
    dex.send_user_message(S, "are you there?")
    dex.add_assistant_message(S, "t-durable", "Hi!")
    assert dex.open_turn(S) is None
    assert dex.get_agent_snapshot(S).messages[-1].text == "are you there?"
    # A turn that is not durable keeps the old meaning: a message, no turn
    dex.add_assistant_message(S, "t-plain", "Calling a tool.")
    assert dex.open_turn(S) is None
    assert turn.turn_id == "t-durable"
    with pytest.raises(TurnConflictError, match="input"):
        dex.begin_turn(S, "another input", turn_id="t-durable")


# -- a call recorded but never sent ---------------------------------------------------------

_DIE_BEFORE_PUBLISH = textwrap.dedent("""
    import os, sys
    import dex_tasks.agent.client as client_module
    from dex_tasks import DexClient
    import workers.example_tools  # noqa: F401

    def die(*_args, **_kwargs):
        os._exit(9)  # the process dies between the store's commit and the publish

    client_module.publish = client_module.publish_many = die
    dex = DexClient.from_env()
    turn = dex.begin_turn(sys.argv[2], "charge me")
    dex.record_step(sys.argv[2], turn.turn_id, 0, sys.argv[1], [{
        "tool_call_id": "c2", "tool": "charge_card",
        "arguments": {"customer_id": "cu_1", "amount_cents": 500}}])
""")


def _die_between_commit_and_publish(settings: DexSettings, ledger_path: Path,
                                    session: str) -> None:
    done = subprocess.run([sys.executable, "-c", _DIE_BEFORE_PUBLISH, RESPONSE, session],
                          cwd=ROOT,
                          env=settings_env(settings, ledger_path), timeout=60,
                          capture_output=True)
    assert done.returncode == 9, done.stderr.decode()


def test_a_call_recorded_but_never_sent_is_sent_once_and_queued_input_waits_for_the_turn(
    dex: DexClient, store_settings: DexSettings, ledger_path: Path, tmp_path: Path,
) -> None:
    # Given two agent processes that each died after committing a step and its call, before
    # the publish (one worker serves both stories, and the delivery one after them)
    for session in ("s-next", "s-sweep"):
        _die_between_commit_and_publish(store_settings, ledger_path, session)
    turns = {session: dex.open_turn(session) for session in ("s-next", "s-sweep")}
    calls = {}
    for session, turn in turns.items():
        assert turn is not None
        [calls[session]] = turn.steps[0].calls
        assert calls[session].status is CallStatus.QUEUED
    worker = _worker(store_settings, ledger_path, tmp_path)
    try:
        # When one restarted agent records its step again (its replay), after the grace a
        # live recorder has to publish: the call is sent
        next_turn = turns["s-next"]
        assert next_turn is not None
        sent_after = calls["s-next"].created_at.timestamp() + UNSENT_GRACE_SECONDS
        wait_until(lambda: time.time() > sent_after, 10, "the grace to pass")
        dex.record_step("s-next", next_turn.turn_id, 0, RESPONSE, [CHARGE])
        # And when the republisher runs a few seconds after the other was recorded: sent too
        # (not before: its recorder may be publishing it)
        rt = Runtime(settings=dex.settings, store=dex.store,
                     redis=redis.Redis.from_url(dex.settings.redis_url), app=dex.app)
        created = calls["s-sweep"].created_at.timestamp()
        assert republish_stranded(rt, now=created + 1) == 0
        assert republish_stranded(rt, now=created + UNSENT_GRACE_SECONDS + 0.5) == 1
        # Then each runs, once, and a further replay sends nothing again
        for session, call in calls.items():
            assert dex.wait(call.key, 20).status is CallStatus.SUCCEEDED
            turn = turns[session]
            assert turn is not None
            dex.record_step(session, turn.turn_id, 0, RESPONSE, [CHARGE])
        _queued_input_is_delivered_after_the_turn(dex)
    finally:
        worker.kill_all()
    runs = ledger.executions(ledger_path)
    assert [runs[call.key] for call in calls.values()] == [1, 1]


def _queued_input_is_delivered_after_the_turn(dex: DexClient) -> None:
    # Given a turn whose one step called a tool, and a second input sent meanwhile (twice:
    # a restarted sender sends it again)
    turn = dex.begin_turn(S, "Where is order 1001?")
    [call] = dex.record_step(S, turn.turn_id, 0, RESPONSE, [LOOKUP])
    for _ in range(2):
        other = dex.begin_turn(S, "And cancel order 1002")
        assert (other.turn_id, other.queued_input) == (turn.turn_id, True)
    assert dex.wait(call.key, 20).status is CallStatus.SUCCEEDED
    # Then the call's end does not deliver it: the turn is open until the model answers
    queued = [m for m in dex.get_agent_snapshot(S).messages if m.status == "queued"]
    assert [m.text for m in queued] == ["And cancel order 1002"]

    # When the model answers without tools
    answer = dex.end_turn(S, turn.turn_id, "Order 1001 has shipped.")

    # Then the turn is over and the queued input is delivered after the answer, which comes
    # after the turn's tool message
    assert dex.open_turn(S) is None
    roles = [(m.role, m.text or m.tool) for m in dex.get_agent_snapshot(S).messages]
    assert roles == [(MessageRole.USER, "Where is order 1001?"),
                     (MessageRole.ASSISTANT, None),  # the step: its calls, no text
                     (MessageRole.TOOL, "lookup_order"),
                     (MessageRole.ASSISTANT, "Order 1001 has shipped."),
                     (MessageRole.USER, "And cancel order 1002")]
    assert dex.get_agent_snapshot(S).messages[-1].status == "delivered"
    # And ending it again with the same answer is a no-op; another answer conflicts
    assert dex.end_turn(S, turn.turn_id, "Order 1001 has shipped.").id == answer.id
    with pytest.raises(TurnConflictError, match="answer"):
        dex.end_turn(S, turn.turn_id, "Something else")
    with pytest.raises(TurnConflictError, match="has ended"):
        dex.record_step(S, turn.turn_id, 1, RESPONSE, [])
    # And the ended turn, named by id, is returned with its answer
    ended = dex.begin_turn(S, "Where is order 1001?", turn_id=turn.turn_id)
    assert (ended.status, ended.answer) == ("ended", "Order 1001 has shipped.")




def test_a_queued_input_run_again_after_its_turn_begins_from_the_message_that_waited(
    dex: DexClient,
) -> None:
    # Given an open turn, and another input queued behind it (sent twice: held once)
    first = dex.begin_turn("q", "Refund charge ch_1")
    for _ in range(2):
        assert dex.begin_turn("q", "Where is order 1002?").queued_input
    dex.end_turn("q", first.turn_id, "Refunded.")
    # And, while a later turn is open, the same input again: not queued a second time, since
    # the first one, delivered, has begun no turn yet
    later = dex.begin_turn("q", "Anything else?")
    assert dex.begin_turn("q", "Where is order 1002?").queued_input
    dex.end_turn("q", later.turn_id, "No.")
    users = [m for m in dex.get_agent_snapshot("q").messages if m.role is MessageRole.USER]
    assert [(m.text, m.status) for m in users] == [("Refund charge ch_1", "delivered"),
                                                   ("Where is order 1002?", "delivered"),
                                                   ("Anything else?", "delivered")]
    waited = users[1]

    # When it is run again (the same code, the same input) once the turns before it ended
    turn = dex.begin_turn("q", "Where is order 1002?")
    # Then its turn begins from the message that waited: the session holds it once
    assert (turn.status, turn.queued_input, turn.resumed) == ("open", False, False)
    users = [m for m in dex.get_agent_snapshot("q").messages if m.role is MessageRole.USER]
    assert [m.text for m in users].count("Where is order 1002?") == 1
    assert [(m.id, m.turn_id) for m in users if m.text == "Where is order 1002?"] == [
        (waited.id, turn.turn_id)]
    # And a restart finds that turn open; a third run of the input, once it ended, is a new
    # turn with a message of its own (the waiting one has been answered)
    assert dex.begin_turn("q", "Where is order 1002?").resumed
    dex.end_turn("q", turn.turn_id, "Packed.")
    again = dex.begin_turn("q", "Where is order 1002?")
    assert again.turn_id != turn.turn_id
    users = [m for m in dex.get_agent_snapshot("q").messages if m.role is MessageRole.USER]
    assert [m.text for m in users].count("Where is order 1002?") == 2
