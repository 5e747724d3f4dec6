"""The beat schedule of dex-tasks: every sweep job, every ``DEX_SWEEP_INTERVAL_SECONDS``.

Beat runs each job in its own process (``dex_tasks.worker.beat``), except those that need the tool
modules (``reconcile_unknown``), which it sends to the workers. Those entries expire after one
interval, so a backlog of them (beat running while no worker consumes) does not pile up work
that the next run does anyway.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO, Any

from dex_tasks.broker.celery_app import SWEEP
from dex_tasks.errors import ConfigurationError
from dex_tasks.settings import DexSettings
from dex_tasks.worker.beat import IN_BEAT, ON_WORKERS
from dex_tasks.worker.sweeps import JOBS

MAX_BEATS_PER_DIR = 16


def build(settings: DexSettings) -> dict[str, dict[str, Any]]:
    """The schedule for ``settings``: one entry per sweep job."""
    interval = settings.sweep_interval_seconds
    return {
        f"dex.{job}": (
            {"task": SWEEP, "schedule": interval, "args": [job],
             "options": {"expires": interval}}
            if job in ON_WORKERS else
            {"task": IN_BEAT, "schedule": interval, "args": [job]}
        )
        for job in JOBS
    }


def schedule_file(state_dir: Path) -> tuple[Path, IO[str]]:
    """The schedule file a beat starting now may use in ``state_dir``, and the open lock
    file that reserves it for as long as it stays open.

    Beat's schedule is a ``shelve`` database, which two processes must not open at once
    (Celery deletes a file it cannot open as "corrupted"). The first beat gets
    ``beat-schedule``, a second one on the same machine ``beat-schedule-2``, and so on: the
    names are stable, so a restarted beat reuses its file instead of littering new ones.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigurationError(
            f"cannot create beat's state directory {str(state_dir)!r} (DEX_STATE_DIR): {err}"
        ) from None
    for n in range(1, MAX_BEATS_PER_DIR + 1):
        name = "beat-schedule" if n == 1 else f"beat-schedule-{n}"
        try:
            lock = open(state_dir / f"{name}.lock", "a")
        except OSError as err:
            raise ConfigurationError(
                f"cannot write in beat's state directory {str(state_dir)!r} (DEX_STATE_DIR): "
                f"{err}"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return state_dir / name, lock
    raise ConfigurationError(
        f"{MAX_BEATS_PER_DIR} beats already use {str(state_dir)!r}: give this one its own "
        "DEX_STATE_DIR"
    )


beat_schedule = build(DexSettings())
