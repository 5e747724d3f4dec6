"""``Runs.start``, the lease a worker child takes for each attempt of a retrying call
(``broker/runs.py``): what it answers and what it leaves in Redis, on a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from dex_tasks.broker.runs import BUSY, RUNS_KEY, Runs, attempts_key, run_key
from tests.helpers import wait_until


@pytest.fixture
def runs(redis_url: str) -> Iterator[Runs]:
    client = redis.Redis.from_url(redis_url)
    yield Runs(client)
    client.close()


def _start(runs: Runs, key: str, owner: str, *, stored: int = 0, most: int = 3,
           lease: float = 30.0) -> tuple[int, int]:
    return runs.start(key, owner, stored_attempts=stored, max_attempts=most,
                      lease_seconds=lease, started=1_700_000_000.25, ttl=600,
                      tool="lookup_order", effect="read")


def test_an_attempt_is_started_counted_and_leased(runs: Runs) -> None:
    # When the first attempt of a call starts
    before = float(runs.client.time()[0])
    assert _start(runs, "s/t/a", "node:1") == (1, 1)

    # Then its run, its count and its lease are in Redis, with their TTLs
    client = runs.client
    assert client.hgetall(run_key("s/t/a")) == {
        b"worker": b"node:1", b"started": b"1700000000.25", b"attempt": b"1",
        b"tool": b"lookup_order", b"effect": b"read"}
    assert runs.attempts("s/t/a") == 1
    assert 0 < client.ttl(run_key("s/t/a")) <= 600
    assert 0 < client.ttl(attempts_key("s/t/a")) <= 600
    lease = client.zscore(RUNS_KEY, "s/t/a")
    assert lease is not None and before + 29 <= lease <= time.time() + 31


def test_a_second_attempt_while_the_lease_lives_is_busy(runs: Runs) -> None:
    # Given an attempt running under a live lease
    assert _start(runs, "s/t/b", "node:1") == (1, 1)

    # When another delivery of the call starts an attempt
    # Then it is told another attempt holds the call, and nothing changed
    assert _start(runs, "s/t/b", "node:2") == (BUSY, BUSY)
    run = runs.get("s/t/b")
    assert run is not None and run.worker == "node:1"
    assert runs.attempts("s/t/b") == 1


def test_attempts_count_on_from_the_larger_of_redis_and_the_store(runs: Runs) -> None:
    # Given a call whose lease ran out (its worker lost) after one attempt
    assert _start(runs, "s/t/c", "node:1", lease=0.001) == (1, 1)
    wait_until(lambda: runs.reap("s/t/c") is not None, 10, "the lease to run out and be reaped")

    # When it starts again, the store having counted two attempts already
    # Then the attempt is the third
    assert _start(runs, "s/t/c", "node:2", stored=2) == (3, 3)


def test_no_attempt_starts_once_they_are_used_up(runs: Runs) -> None:
    # When a call whose attempts were all used starts again
    # Then no attempt starts, and the answer says how many there were
    assert _start(runs, "s/t/d", "node:1", stored=3, most=3) == (0, 3)
    assert runs.get("s/t/d") is None


def test_the_start_script_is_loaded_again_after_redis_forgot_it(runs: Runs) -> None:
    # Given a Redis that lost its scripts (a restart, a failover) after a first start
    assert _start(runs, "s/t/e", "node:1") == (1, 1)
    runs.client.script_flush()

    # When another call starts
    # Then it starts all the same
    assert _start(runs, "s/t/f", "node:1") == (1, 1)
    assert runs.get("s/t/f") is not None
