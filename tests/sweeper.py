"""A sweeping process for tests: the named sweep jobs every 0.2 s.

``python -m tests.sweeper JOB [JOB ...]`` (default: the lease reaper and the republisher) reads
the ``DEX_*`` settings like any dex-tasks process. It prints one JSON line with its own clock
(``time.time()``), then one line per round with how many calls the jobs moved, until it is
killed. Tests run it under libfaketime to give it a clock of its own.
"""

from __future__ import annotations

import json
import sys
import time

from dex_tasks.broker.celery_app import create_app
from dex_tasks.errors import StoreUnavailableError
from dex_tasks.settings import DexSettings
from dex_tasks.worker.execution import runtime
from dex_tasks.worker.sweeps import run_job


def main() -> None:
    jobs = sys.argv[1:] or ["reap_expired_leases", "republish_stranded"]
    rt = runtime(create_app(DexSettings()))
    print(json.dumps({"clock": time.time()}), flush=True)
    while True:
        try:
            moved = sum(run_job(rt, job) for job in jobs)
        except StoreUnavailableError:
            moved = 0
        print(json.dumps({"moved": moved}), flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
