"""An attempt of a retrying call that ran but whose ending lost (a reaper recorded an earlier
attempt meanwhile, so the attempt's view of the stored count was stale) keeps its place in the
call's attempt count: the next attempt is numbered after it, so every run of the tool is counted
(the chaos run's ``unclaimed_execution`` and ``attempt_run_twice``, met on CI)."""

from __future__ import annotations

import time

import pytest

import workers.example_tools  # noqa: F401 - registers lookup_order in this process
from dex_tasks import CallStatus, DexSettings
from dex_tasks.worker.claiming import claim_leased
from dex_tasks.worker.endings import Attempt, finish
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.leased import lost_run
from tests.conftest import fast_settings
from tests.test_store import call_row


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    # Both stores: conftest's ``rt`` runtime is built on this client's settings.
    return fast_settings(redis_url, database_url)


def test_an_attempt_whose_ending_lost_still_counts(rt: Runtime) -> None:
    key = f"s/t/stale-{time.time_ns()}"
    assert rt.store.insert_call(call_row(key, effect="read", tool="lookup_order",
                                         arguments='{"order_id":"1"}', max_attempts=5))
    # Given a first attempt whose worker was lost, recorded by the reaper (stored count 1)
    first = claim_leased(rt, key, "node-a:1")
    assert isinstance(first, tuple) and first[3].number == 1
    stored = rt.store.get_call(key)
    assert stored is not None
    assert lost_run(rt, stored, "node-a:1", "lost", republish=False) is CallStatus.QUEUED
    # and a second attempt that read the call before that record (its stored count 0): it
    # runs as attempt 2, and its ending loses, guarded on the count it read
    assert rt.runs.start(key, "node-b:1", stored_attempts=0, max_attempts=5,
                         lease_seconds=30, started=time.time(), ttl=600) == (2, 2)
    late = Attempt("node-b:1", 2, stored=0, started=time.time())
    assert not finish(rt, key, late, CallStatus.SUCCEEDED, result="1")

    # When the call is delivered again
    third = claim_leased(rt, key, "node-c:1")

    # Then that attempt is the third, after both that ran, and its ending records 3
    assert isinstance(third, tuple)
    assert third[3].number == 3
    assert finish(rt, key, third[3], CallStatus.SUCCEEDED, result="1")
    ended = rt.store.get_call(key)
    assert ended is not None and (ended.status, ended.attempts) == ("succeeded", 3)
