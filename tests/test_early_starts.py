"""An attempt of a retrying call started before its call is read (``claiming.claim_leased``
with the tool its message names, ``Runs.start_later``): kept only when it is exactly the start
made after the read, otherwise taken back (``Runs.undo_start``) without a trace in Redis, and
the call decided as before. On a real Redis and both stores."""

from __future__ import annotations

import time
from typing import Any

import pytest

import workers.example_tools  # noqa: F401 - registers lookup_order in this process
from dex_tasks import CallStatus, DexSettings
from dex_tasks.broker import runs as runs_module
from dex_tasks.broker.runs import BUSY, RUNS_KEY, Runs, attempts_key, run_key
from dex_tasks.registry import get_local_tool
from dex_tasks.worker import claiming
from dex_tasks.worker.claiming import claim_leased
from dex_tasks.worker.endings import finish
from dex_tasks.worker.execution import Runtime
from tests.conftest import fast_settings
from tests.test_store import call_row

TOOL = "lookup_order"


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    # Both stores: conftest's ``rt`` runtime is built on this client's settings.
    return fast_settings(redis_url, database_url)


@pytest.fixture(autouse=True)
def known_effect(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has started a call of the tool before: it knows the tool's effect class,
    and Redis has the start's script."""
    monkeypatch.setitem(claiming._SEEN, TOOL, ("read", 3))
    rt.redis.script_load(runs_module._START)


def _call(rt: Runtime, **over: Any) -> str:
    key = f"s/t/early-{time.time_ns()}"
    row = call_row(key, effect="read", tool=TOOL, arguments='{"order_id":"1"}',
                   max_attempts=3)
    row.update(over)
    assert rt.store.insert_call(row)
    return key


def _no_second_start(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("the start after the read was not expected")

    monkeypatch.setattr(rt.runs, "start", refused)


def _nothing_in_redis(rt: Runtime, key: str) -> None:
    assert rt.runs.get(key) is None
    assert rt.redis.zscore(RUNS_KEY, key) is None
    assert rt.redis.get(attempts_key(key)) is None


def test_a_queued_call_runs_on_the_start_sent_before_its_read(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _call(rt)
    _no_second_start(rt, monkeypatch)

    leased = claim_leased(rt, key, "node-a:1", TOOL)

    assert isinstance(leased, tuple)
    call, _tool, arguments, attempt = leased
    assert (call.status, call.attempts, call.worker) == ("running", 1, "node-a:1")
    assert arguments["order_id"] == "1"
    assert (attempt.number, attempt.stored, attempt.owner) == (1, 0, "node-a:1")
    assert rt.redis.hgetall(run_key(key))[b"effect"] == b"read"
    assert rt.runs.attempts(key) == 1
    assert finish(rt, key, attempt, CallStatus.SUCCEEDED, result="1")
    ended = rt.store.get_call(key)
    assert ended is not None and (ended.status, ended.attempts) == ("succeeded", 1)


def test_a_duplicate_of_an_ended_call_leaves_nothing_in_redis(rt: Runtime) -> None:
    key = _call(rt)
    first = claim_leased(rt, key, "node-a:1", TOOL)
    assert isinstance(first, tuple)
    assert finish(rt, key, first[3], CallStatus.SUCCEEDED, result="1")
    rt.runs.forget([key])  # as the announcement of the ending does

    # When the call's message is delivered again
    assert claim_leased(rt, key, "node-b:1", TOOL) is None

    # Then the start sent before the read was taken back whole
    _nothing_in_redis(rt, key)


def test_a_store_count_above_redis_numbers_the_attempt_after_the_store(rt: Runtime) -> None:
    # Given a call whose Redis count was lost (a failover) after two recorded attempts
    key = _call(rt, attempts=2)

    leased = claim_leased(rt, key, "node-a:1", TOOL)

    # Then the attempt is the third, as the start after the read numbers it
    assert isinstance(leased, tuple)
    assert (leased[3].number, leased[3].stored) == (3, 2)
    assert rt.runs.attempts(key) == 3
    run = rt.runs.get(key)
    assert run is not None and (run.worker, run.attempt) == ("node-a:1", 3)


def test_a_call_whose_attempts_are_used_up_in_redis_ends_with_that_count(rt: Runtime) -> None:
    # Given a call whose three attempts were counted in Redis (their workers lost), none
    # recorded in the store yet
    key = _call(rt)
    rt.redis.set(attempts_key(key), 3, ex=600)

    outcome = claim_leased(rt, key, "node-a:1", TOOL)

    # Then it ends as a read whose attempts ran out, no run left behind
    assert not isinstance(outcome, tuple) and outcome is not None
    assert outcome.status is CallStatus.FAILED
    ended = rt.store.get_call(key)
    assert ended is not None and (ended.status, ended.attempts) == ("failed", 3)
    assert rt.runs.get(key) is None and rt.redis.zscore(RUNS_KEY, key) is None


def test_an_expired_call_ends_did_not_run_with_nothing_counted(rt: Runtime) -> None:
    key = _call(rt, expires_at=time.time() - 1)

    outcome = claim_leased(rt, key, "node-a:1", TOOL)

    assert not isinstance(outcome, tuple) and outcome is not None
    assert outcome.status is CallStatus.FAILED
    ended = rt.store.get_call(key)
    assert ended is not None and (ended.status, ended.attempts) == ("failed", 0)
    _nothing_in_redis(rt, key)


def test_invalid_arguments_end_the_call_with_nothing_counted(rt: Runtime) -> None:
    key = _call(rt, arguments='{"order_id": 5, "extra": true}')

    outcome = claim_leased(rt, key, "node-a:1", TOOL)

    assert not isinstance(outcome, tuple) and outcome is not None
    assert outcome.status is CallStatus.FAILED
    _nothing_in_redis(rt, key)


def test_a_call_of_another_effect_starts_with_its_own(rt: Runtime) -> None:
    # Given a call whose effect is not the one this process learned for its tool
    key = _call(rt, effect="idempotent_write")

    leased = claim_leased(rt, key, "node-a:1", TOOL)

    # Then its run names its own effect, and the process learned it
    assert isinstance(leased, tuple) and leased[3].number == 1
    assert rt.redis.hgetall(run_key(key))[b"effect"] == b"idempotent_write"
    assert rt.runs.attempts(key) == 1
    assert claiming._SEEN[TOOL] == ("idempotent_write", 3)


def test_a_call_another_attempt_holds_is_a_duplicate_and_keeps_its_run(rt: Runtime) -> None:
    key = _call(rt)
    first = claim_leased(rt, key, "node-a:1", TOOL)
    assert isinstance(first, tuple)

    assert claim_leased(rt, key, "node-b:1", TOOL) is None

    run = rt.runs.get(key)
    assert run is not None and (run.worker, run.attempt) == ("node-a:1", 1)
    assert rt.runs.attempts(key) == 1


def test_a_failed_read_takes_the_start_back(rt: Runtime,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    key = _call(rt)

    def unreachable(_key: str) -> Any:
        raise ConnectionError("the store is away")

    monkeypatch.setattr(rt.store, "get_call_columns", unreachable)
    with pytest.raises(ConnectionError):
        claim_leased(rt, key, "node-a:1", TOOL)

    _nothing_in_redis(rt, key)


def test_checks_that_fail_unexpectedly_take_the_start_back(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a tool whose validation fails with an error that is not InvalidArguments
    key = _call(rt)
    tool = get_local_tool(TOOL)
    assert tool is not None

    def broken(_arguments: Any) -> Any:
        raise RuntimeError("a validator with a bug")

    monkeypatch.setattr(tool, "validate", broken)
    with pytest.raises(RuntimeError):
        claim_leased(rt, key, "node-a:1", TOOL)

    # Then the error goes up as before, and no lease is left for the reaper to count
    _nothing_in_redis(rt, key)


@pytest.mark.parametrize("early", [True, False], ids=["started early", "started after"])
def test_a_call_the_model_refuses_takes_its_start_back(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch, early: bool) -> None:
    # Given a queued call whose row passes the checks (they read its columns) but is refused
    # when it is built as the running call
    key = _call(rt)

    def refused(_row: Any) -> Any:
        raise ValueError("a row the model refuses")

    monkeypatch.setattr(claiming, "stored_call", refused)
    with pytest.raises(ValueError):
        claim_leased(rt, key, "node-a:1", TOOL if early else None)

    # Then the error goes up, and the attempt started for it is taken back
    _nothing_in_redis(rt, key)


def test_undo_start_takes_back_only_that_attempt(rt: Runtime) -> None:
    runs = Runs(rt.redis)
    key = f"s/t/undo-{time.time_ns()}"
    # An attempt started early over a count of one, then taken back: the count is one again
    rt.redis.set(attempts_key(key), 1, ex=600)
    assert runs.start_later(key, "node-a:1", max_attempts=5, lease_seconds=30,
                            started=1.0, ttl=600, tool=TOOL, effect="read").number() == 2
    assert runs.undo_start(key, "node-a:1", 2, ttl=600)
    assert runs.get(key) is None and rt.redis.zscore(RUNS_KEY, key) is None
    assert runs.attempts(key) == 1
    # Another owner's attempt, or a count that moved on, is left alone
    assert runs.start_later(key, "node-b:1", max_attempts=5, lease_seconds=30,
                            started=1.0, ttl=600, tool=TOOL, effect="read").number() == 2
    assert not runs.undo_start(key, "node-a:1", 2, ttl=600)
    assert runs.start_later(key, "node-c:1", max_attempts=5, lease_seconds=30,
                            started=1.0, ttl=600, tool=TOOL, effect="read").number() == BUSY
    rt.redis.set(attempts_key(key), 4, ex=600)
    assert runs.undo_start(key, "node-b:1", 2, ttl=600)
    assert runs.attempts(key) == 4
