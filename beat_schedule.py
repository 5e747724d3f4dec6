"""The beat schedule of dex-tasks: every sweep job, every ``DEX_SWEEP_INTERVAL_SECONDS``.

Each entry expires after one interval, so a backlog of sweep messages (beat running while no
worker consumes) does not pile up work that the next run does anyway.
"""

from __future__ import annotations

from typing import Any

from dex_tasks.celery_app import SWEEP
from dex_tasks.settings import DexSettings
from dex_tasks.sweeps import JOBS


def build(settings: DexSettings) -> dict[str, dict[str, Any]]:
    """The schedule for ``settings``: one entry per sweep job."""
    interval = settings.sweep_interval_seconds
    return {
        f"dex.{job}": {
            "task": SWEEP,
            "schedule": interval,
            "args": [job],
            "options": {"expires": interval},
        }
        for job in JOBS
    }


beat_schedule = build(DexSettings())
