"""A store that stalls never gets a live call reaped (issue 11, item 4).

Another process holds SQLite's write lock for 8 s while calls run: the workers' lease renewals
wait, their leases run out by the store's clock, and a sweeper (its own process, every 0.2 s)
sees them expired and waits for the lock as well. The reaper must not win: see the comment in
``sweeps.reap_expired_leases``. (PostgreSQL's stall, the server unreachable for longer than a
lease, is in ``test_store_outages.py``.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient, DexSettings
from tests.conftest import StartWorker, fast_settings
from tests.helpers import Sweeper, calls_on_every_path, started_pid
from workers import ledger

# Holds the database's write lock (BEGIN IMMEDIATE) for argv[2] seconds: a long migration, a
# backup, a stuck writer in some other process.
LOCKER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
print("released", flush=True)
"""


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    # A 3 s lease, renewed every second: the 8 s lock outlasts it more than twice.
    return fast_settings(redis_url, sqlite_url, lease_seconds=3.0)


@pytest.fixture
def sweeper(env: dict[str, str], tmp_path: Path) -> Iterator[Sweeper]:
    running = Sweeper.start(env, tmp_path / "sweeper.log")
    yield running
    running.stop()


def test_a_write_lock_held_8s_by_another_process_reaps_no_live_call(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, sqlite_url: str,
    sweeper: Sweeper,
) -> None:
    # Given reads, idempotent writes and single-attempt charges running, some ending during
    # the stall below and some after it
    start_worker(concurrency=6)
    keys = [*calls_on_every_path(client, "short", 2), *calls_on_every_path(client, "long", 12)]
    for key in keys:
        started_pid(ledger_path, key)

    # When another process takes the write lock and holds it for 8 s
    path = sqlite_url.removeprefix("sqlite:///")
    with subprocess.Popen([sys.executable, "-c", LOCKER, path, "8"], stdout=subprocess.PIPE,
                          text=True) as locker:
        assert locker.stdout is not None
        assert locker.stdout.readline().strip() == "locked"
        locked_at = time.monotonic()
        assert locker.stdout.readline().strip() == "released"
        assert locker.wait(10) == 0 and time.monotonic() - locked_at >= 8

    # Then every call succeeds on its first attempt and each tool ran once
    finals = [client.wait(key, 60) for key in keys]
    for final in finals:
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
    assert ledger.executions(ledger_path) == {key: 1 for key in keys}
    # And the sweeper, reaping every 0.2 s through the stall and after it, moved nothing
    rounds = sweeper.rounds()
    assert sum(rounds) == 0 and len(rounds) > 10
    # though it found leases run out by the store's clock, renewed before its reap
    assert "renewed before the reap" in sweeper.log()
