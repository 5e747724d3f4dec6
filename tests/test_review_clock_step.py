"""Issue 19, finding 12: a forward step of the store's clock reaps no live call.

Leases are written and judged on the store's clock (PostgreSQL's ``clock_timestamp()``), so a
step of that clock (an NTP correction, a VM resumed) made every lease look expired at once, and
the reaper took the live calls before their workers' next renewal.

The step is made the way every process sees it: this test's database resolves
``clock_timestamp()`` to a function of its own (``search_path = public, pg_catalog``) that adds
an offset the test sets, so workers, their renewals and the reaper all read the stepped clock.
(libfaketime cannot step it for every process: a worker under it cannot renew its leases, see
``test_clock_skew.py``; on SQLite the store's clock is the machine's.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from dex_tasks import CallStatus, DexClient, DexSettings
from tests.conftest import StartWorker, fast_settings
from tests.helpers import Sweeper, calls_on_every_path, started_pid, wait_until
from workers import ledger

LEASE = 9.0  # renewed every 3 s
STEP = 60.0


@pytest.fixture
def settings(redis_url: str, postgres_url: str) -> DexSettings:
    return fast_settings(redis_url, postgres_url, lease_seconds=LEASE)


@pytest.fixture
def steppable_clock(postgres_url: str, settings: DexSettings) -> Iterator[object]:
    """The store's clock of this database (its schema made first), plus an offset that
    ``_step`` sets."""
    with DexClient(settings):
        pass
    engine = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    name = make_url(postgres_url).database
    with engine.connect() as conn:
        conn.execute(text("CREATE TABLE dex_test_clock (offset_s float8 NOT NULL)"))
        conn.execute(text("INSERT INTO dex_test_clock VALUES (0)"))
        conn.execute(text(
            "CREATE FUNCTION public.clock_timestamp() RETURNS timestamptz LANGUAGE sql "
            "VOLATILE AS $$ SELECT pg_catalog.clock_timestamp() + make_interval(secs => "
            "(SELECT offset_s FROM public.dex_test_clock)) $$"))
        conn.execute(text(f'ALTER DATABASE "{name}" SET search_path = public, pg_catalog'))
    yield engine
    engine.dispose()


def _step(engine: object, seconds: float) -> None:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        conn.execute(text("UPDATE dex_test_clock SET offset_s = :s"), {"s": seconds})


def test_a_forward_step_of_the_store_clock_reaps_no_live_call(
    steppable_clock: object, settings: DexSettings, env: dict[str, str],
    start_worker: StartWorker, ledger_path: Path, tmp_path: Path,
) -> None:
    # Given calls of every path running 8 s on a worker, and a reaper every 0.2 s, all on a
    # store whose clock the test can step
    with DexClient(settings) as client:
        start_worker(concurrency=3)
        sweeper = Sweeper.start(env, tmp_path / "sweeper.log", "reap_expired_leases")
        try:
            keys = calls_on_every_path(client, "step", 8)
            for key in keys:
                started_pid(ledger_path, key)

            # When the store's clock steps a minute forward, just after a renewal (so that the
            # next renewal is a whole interval away)
            # (the charge's lease: the retrying calls' are in Redis, on Redis's clock)
            first = client.store.get_call(keys[2])
            assert first is not None and first.lease_expires_at is not None
            wait_until(lambda: client.store.get_call(keys[2]).lease_expires_at  # type: ignore[union-attr]
                       != first.lease_expires_at, 10, "a lease renewal")
            _step(steppable_clock, STEP)
            assert client.store.store_time() > time.time() + STEP - 1

            # Then each call still succeeds on its first attempt, its tool run once, and the
            # reaper moved nothing
            for key in keys:
                final = client.wait(key, 40)
                assert final.status is CallStatus.SUCCEEDED, final.error
                assert final.attempts == 1
            assert ledger.executions(ledger_path) == {key: 1 for key in keys}
            assert sum(sweeper.rounds()) == 0
            assert "store's clock stepped forward" in sweeper.log()
        finally:
            sweeper.stop()
