"""The plain-Celery baseline: a no-op task, JSON only, Redis broker and Redis result backend.

Started by the throughput benchmark as ``celery -A bench.raw_tasks worker -c 2`` (prefork), and
by the I/O benchmark with ``--pool threads -c 200`` (the ``sleep`` task),
with ``BENCH_RAW_BROKER`` and ``BENCH_RAW_BACKEND`` naming the same private Redis server the
dex-tasks worker uses. Everything else is Celery's default (prefetch multiplier 4, early ack),
because the baseline is what a team gets from Celery without dex-tasks.
"""

from __future__ import annotations

import os
import time

from celery import Celery

QUEUE = "bench.raw"

NOOP = "bench.noop"
SLEEP = "bench.sleep"


def create_app(broker: str, backend: str) -> Celery:
    """The baseline app (the worker's and the benchmark's), with the no-op task registered."""
    celery = Celery("bench_raw", broker=broker, backend=backend, set_as_current=False)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_accept_content=["json"],
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        enable_utc=True,
    )

    # shared=False: a shared task would be added to every app created later in this process
    # (the benchmark creates one per store) and collide with that app's own no-op.
    @celery.task(name=NOOP, shared=False)
    def noop() -> None:
        """Does nothing: the benchmark measures what it costs to run a task at all."""
        return None

    @celery.task(name=SLEEP, shared=False)
    def sleep(seconds: float) -> None:
        """Waits like an I/O-bound tool (an HTTP call) for ``seconds``."""
        time.sleep(seconds)

    return celery


# What ``celery -A bench.raw_tasks worker`` loads.
app = create_app(
    os.environ.get("BENCH_RAW_BROKER", "redis://127.0.0.1:6379/1"),
    os.environ.get("BENCH_RAW_BACKEND", "redis://127.0.0.1:6379/2"),
)
