"""Clock skew never reaps a live call (issue 11, item 4): leases run on the store's clock.

Processes whose clocks are off by 10 s, made so by libfaketime (``LD_PRELOAD``), on PostgreSQL,
whose clock (the server's) is the one every lease is written and judged with. (SQLite's clock
is the machine's, shared by every process that can write the file, so a process with a clock
of its own is not a SQLite situation: see ``test_store_stalls.py`` for SQLite.)

libfaketime also shifts the monotonic clock, and then the timed waits of Python threads
(``threading.Event.wait(timeout)``, through ``sem_clockwait``) never return; leaving the
monotonic clock alone breaks ``time.sleep`` instead. A worker under libfaketime therefore
cannot run its lease-renewing thread, so the skewed worker below runs calls shorter than one
lease; renewals meet a skewed reaper in the first test, on a worker with a true clock.

The sweepers here run only the lease reaper. The republisher compares ``published_at`` (the
publisher's clock) with its own clock; its window (300 s by default) dwarfs any skew a
machine keeps for long, and what a skew does there is republish early, which the claim makes
harmless.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient, DexSettings
from tests.conftest import StartWorker, fast_settings
from tests.helpers import Sweeper, calls_on_every_path, faketime_env, started_pid
from workers import ledger


@pytest.fixture
def settings(redis_url: str, postgres_url: str) -> DexSettings:
    # A 3 s lease, renewed every second.
    return fast_settings(redis_url, postgres_url, lease_seconds=3.0)


def _calls_run_once_unreaped(client: DexClient, ledger_path: Path, sweeper: Sweeper,
                             sleep: float) -> None:
    """A read, an idempotent write and a single-attempt charge, each running ``sleep`` s while
    ``sweeper`` reaps: each must succeed on its first attempt, its tool run once, and the
    sweeper must have moved nothing."""
    keys = calls_on_every_path(client, "skew", sleep)
    for key in keys:
        started_pid(ledger_path, key)
    for key in keys:
        final = client.wait(key, 60)
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
    assert ledger.executions(ledger_path) == {key: 1 for key in keys}
    rounds = sweeper.rounds()
    assert sum(rounds) == 0 and len(rounds) > 5


@pytest.fixture
def sweepers(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Sweeper]]:
    """Start lease-reaping processes (every 0.2 s), with a clock offset if given."""
    started: list[Sweeper] = []

    def start(offset: str | None = None) -> Sweeper:
        clock = faketime_env(offset) if offset else {}
        sweeper = Sweeper.start({**env, **clock}, tmp_path / f"sweeper-{len(started)}.log",
                                "reap_expired_leases")
        started.append(sweeper)
        return sweeper

    yield start
    for sweeper in started:
        sweeper.stop()


@pytest.mark.long  # make chaos; in make test: the worker ten seconds behind, below
def test_a_sweeper_ten_seconds_ahead_reaps_no_live_call(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    sweepers: Callable[..., Sweeper],
) -> None:
    # Given a sweeper whose clock is 10 s ahead of the store's
    sweeper_ahead = sweepers("+10s")
    assert sweeper_ahead.clock() > time.time() + 9

    # When calls run for 6 s (two leases, renewed by their worker) while it reaps every 0.2 s,
    # then each succeeds on its first attempt, its tool run once, and nothing was reaped
    start_worker(concurrency=3)
    _calls_run_once_unreaped(client, ledger_path, sweeper_ahead, sleep=6)


def test_a_worker_ten_seconds_behind_gets_whole_leases(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    sweepers: Callable[..., Sweeper],
) -> None:
    # Given a worker whose clock is 10 s behind the store's, and a sweeper reaping every 0.2 s
    before = time.time()
    start_worker(concurrency=3, extra_env=faketime_env("-10s"))
    sweeper = sweepers()

    # When it runs calls of 2 s (within one 3 s lease: see the module's doc), then each
    # succeeds on its first attempt, its tool run once, and nothing was reaped: the claim's
    # lease was counted on the store's clock, not from 10 s ago
    _calls_run_once_unreaped(client, ledger_path, sweeper, sleep=2)
    # And the worker's clock really was behind: its tools wrote their ledger lines in the past
    assert all(entry["at"] < before for entry in ledger.read(ledger_path))
