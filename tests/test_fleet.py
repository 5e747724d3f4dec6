"""A small fleet (``chaos/fleet.py``), the short representative of ``python -m chaos.fleet``:
worker processes on two hosts (network namespaces) through PgBouncer in transaction mode to a
PostgreSQL of its own with ``max_connections = 40``, Redis behind Sentinel; a point of the
curve, then a Sentinel failover under load: no single-attempt call runs twice, every call
ends, calls end again within the bound.

Needs root, ``ip``, ``iptables``, ``pgbouncer`` and PostgreSQL's server binaries: skipped
without them locally, failed on CI (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chaos.fleet import Config, run
from tests.netns import missing_tools


@pytest.fixture
def fleet_machine() -> None:
    missing = missing_tools() + [tool for tool in ("pgbouncer",) if shutil.which(tool) is None
                                 and not os.path.exists("/usr/sbin/pgbouncer")]
    if not any(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        missing.append("PostgreSQL's initdb")
    if missing:
        message = f"the fleet test needs {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.timeout(300)
def test_a_small_fleet_behind_pgbouncer_and_sentinel_survives_a_failover(
    fleet_machine: None, tmp_path: Path,
) -> None:
    config = Config(steps=[4], hosts=2, threads=8, sleep=0.05, step_seconds=8.0,
                    warmup_seconds=2.0, failover=True, failover_workers=4,
                    recovery_bound=60.0,
                    settings={"lease_seconds": 6.0, "sweep_interval_seconds": 1.0,
                              "republish_after_seconds": 5.0})
    report = run(config, workdir=tmp_path)
    assert report.problems == [], report.problems
    (step,) = report.steps
    assert step.calls > 0 and step.calls_per_s > 0
    # Every process reached PostgreSQL through the pooler, within its pool.
    assert 0 < step.server_connections <= config.pool_size
    assert report.failover is not None
    assert report.failover.first_end_after_kill <= config.recovery_bound
    assert report.duplicates == 0
    # Calls end succeeded, or failed "did not run" when the master was gone at their publish
    # (report.problems checks that they say so and never ran)
    assert report.calls > 0 and set(report.statuses) <= {"succeeded", "failed"}, report.statuses
