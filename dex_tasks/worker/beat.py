"""The beat process runs the sweeps itself, so no tool can ever delay one.

Sweeps used to be Celery tasks run by the same worker slots as tools: with every slot busy, an
approval with a 2 s deadline was rejected after 38 s and a dead worker's call was reaped after
41 s, and hung tools could hold them off for ever. Here ``dex-tasks beat`` keeps Celery beat's
schedule (``beat_schedule.py``, its persistence, its log lines), but its scheduler runs each
due sweep in a thread of the beat process (:class:`SweepScheduler`) instead of sending it.
Beat imports no tool code and waits for no worker: deadlines pass and lost work is found even
when no worker is running at all.

Each job runs in its own thread, at most one run of a job at a time in this process; two beats
(or a beat and ``dex-tasks sweep``) are kept apart by the Redis lock per job and, in the end,
by the store's guarded transitions (``sweeps.run_job``).

The one exception is ``reconcile_unknown``: it runs the tools' own checkers, which are tool
code, so beat sends it to the workers (:data:`ON_WORKERS`) as before.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from celery.beat import PersistentScheduler

from dex_tasks.worker.execution import runtime
from dex_tasks.worker.sweeps import run_job

log = logging.getLogger("dex_tasks.worker.beat")

# The task name of schedule entries that beat runs in its own process; no worker registers it.
IN_BEAT = "dex.sweep_in_beat"
# Jobs that need the tool modules, and so run on the workers (sent as the ``dex.sweep`` task).
ON_WORKERS = frozenset({"reconcile_unknown"})


class SweepRunner:
    """Runs sweep jobs in threads of this process, never two runs of one job at once."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.threads: dict[str, threading.Thread] = {}
        self.started: dict[str, float] = {}
        self.lock = threading.Lock()

    def start(self, job: str) -> bool:
        """Start ``job`` unless its previous run is still going; True if it started."""
        with self.lock:
            running = self.threads.get(job)
            if running is not None and running.is_alive():
                waited = time.monotonic() - self.started.get(job, time.monotonic())
                where = waiting_on(running)
                # A warning once the run outlasts a few turns: the store (or Redis) is what
                # holds it up, and this names where.
                log.log(logging.WARNING if waited > 30 else logging.INFO,
                        "sweep still running after %.0fs, this turn skipped; it waits in %s",
                        waited, where, extra={"action": "sweep_skipped", "job": job,
                                              "running_for": round(waited, 1),
                                              "waiting_in": where})
                return False
            thread = threading.Thread(target=self._run, args=(job,), name=f"dex-sweep-{job}",
                                      daemon=True)
            self.threads[job] = thread
            self.started[job] = time.monotonic()
            thread.start()
            return True

    def _run(self, job: str) -> None:
        try:
            run_job(runtime(self.app), job)
        except Exception:
            # The next turn runs it again; a sweep must never stop beat.
            log.exception("sweep failed", extra={"action": "sweep_error", "job": job})


def waiting_on(thread: threading.Thread) -> str:
    """Where ``thread`` is now: its innermost dex-tasks frame and the call it is inside (a
    socket read of the database driver, a Redis command, a sleep), for the skipped-turn log."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "(not running)"
    innermost = f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name})"
    ours = None
    while frame is not None:
        if ours is None and "dex_tasks" in frame.f_code.co_filename:
            name = Path(frame.f_code.co_filename).name
            ours = f"{frame.f_code.co_name} ({name}:{frame.f_lineno})"
        frame = frame.f_back
    return f"{ours or '?'}, inside {innermost}"


class SweepScheduler(PersistentScheduler):  # type: ignore[misc]
    """Celery beat's scheduler, running the :data:`IN_BEAT` entries in this process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runner = SweepRunner(self.app)

    def send_task(self, name: str, args: Any = None, kwargs: Any = None,
                  **options: Any) -> Any:
        if name == IN_BEAT:
            job = (args or [None])[0]
            self.runner.start(str(job))
            return None
        return super().send_task(name, args, kwargs, **options)
