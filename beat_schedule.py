"""The beat schedule of dex-tasks: every sweep job, every ``DEX_SWEEP_INTERVAL_SECONDS``.

Beat runs each job in its own process (``dex_tasks.beat``), except those that need the tool
modules (``reconcile_unknown``), which it sends to the workers. Those entries expire after one
interval, so a backlog of them (beat running while no worker consumes) does not pile up work
that the next run does anyway.
"""

from __future__ import annotations

from typing import Any

from dex_tasks.beat import IN_BEAT, ON_WORKERS
from dex_tasks.celery_app import SWEEP
from dex_tasks.settings import DexSettings
from dex_tasks.sweeps import JOBS


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


beat_schedule = build(DexSettings())
