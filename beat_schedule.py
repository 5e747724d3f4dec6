"""The beat schedule under the name the design card uses; it lives in
:mod:`dex_tasks.worker.schedule`, which the wheel ships (this file is not installed)."""

from dex_tasks.worker.schedule import MAX_BEATS_PER_DIR, beat_schedule, build, schedule_file

__all__ = ["MAX_BEATS_PER_DIR", "beat_schedule", "build", "schedule_file"]
