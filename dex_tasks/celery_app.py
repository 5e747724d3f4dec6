"""The Celery app's configuration: JSON only, the queues, no result backend, and publishing.

This module knows no task bodies: an app built here can send calls (``DexClient``, beat, the
sweeps) but runs nothing. The worker registers the task kinds on its own app where it is built
(``main_process.worker_app``), so the layers stay one-way: configuration below execution.

The message of a call carries its idempotency key and nothing else: the store holds the
arguments, the policy snapshot and the status, so a message can be republished at any time and
a stale or duplicate one can do no harm.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from kombu.entity import Queue

from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass
from dex_tasks.settings import DexSettings

RETRYING_QUEUE = "dex.retrying"
SINGLE_ATTEMPT_QUEUE = "dex.single_attempt"
# Sweeps get a queue of their own so a backlog of tool calls never delays reaping lost work.
SWEEPS_QUEUE = "dex.sweeps"
ALL_QUEUES = (RETRYING_QUEUE, SINGLE_ATTEMPT_QUEUE, SWEEPS_QUEUE)
RUN_RETRYING = "dex.call_tool"
RUN_SINGLE_ATTEMPT = "dex.call_single_attempt_tool"
SWEEP = "dex.sweep"


def create_app(settings: DexSettings, *, publisher: bool = False) -> Celery:
    """A Celery app configured for dex-tasks; it sends tasks by name and registers none.

    ``publisher`` is for apps that only send calls (``DexClient``): on a ``redis://`` broker
    they use a transport that reuses its Redis client per channel (see ``transport.py``).
    """
    app = Celery("dex_tasks", broker=settings.redis_url, set_as_current=False)
    if publisher and settings.redis_url.startswith("redis://"):
        app.conf.broker_transport = "dex_tasks.transport:Transport"
    transport = {
        "visibility_timeout": settings.visibility_timeout_seconds,
        "socket_connect_timeout": settings.publish_timeout_seconds,
        "socket_timeout": max(5.0, settings.publish_timeout_seconds),
        "socket_keepalive": True,
        "health_check_interval": 10,
    }
    app.conf.update(
        # Never pickle: write access to the broker plus pickle is remote code execution.
        task_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_serializer="json",
        # The store is the record of every call; a result backend would be a second one.
        result_backend=None,
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        task_default_queue=RETRYING_QUEUE,
        task_queues=[Queue(name) for name in ALL_QUEUES],  # type: ignore[no-untyped-call]
        task_routes={
            RUN_RETRYING: {"queue": RETRYING_QUEUE},
            RUN_SINGLE_ATTEMPT: {"queue": SINGLE_ATTEMPT_QUEUE},
            SWEEP: {"queue": SWEEPS_QUEUE},
        },
        # One message at a time per child: a prefetched message is one a dying worker takes
        # with it, and one the visibility timeout may hand to a second worker.
        worker_prefetch_multiplier=1,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        # Workers keep reconnecting through a long Redis outage instead of exiting after
        # about 100 tries; publishing has its own short retry policy (see publish()).
        broker_connection_max_retries=None,
        # Survives Redis going away while messages are unacked (see DexConsumer).
        worker_consumer="dex_tasks.main_process:DexConsumer",
        broker_connection_timeout=settings.publish_timeout_seconds,
        broker_pool_limit=10,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        enable_utc=True,
    )
    app.dex_settings = settings  # type: ignore[attr-defined]
    return app


def task_name_for(effect: EffectClass) -> str:
    """The task kind that runs calls of this effect class."""
    return RUN_RETRYING if effect.retrying else RUN_SINGLE_ATTEMPT


def publish(app: Celery, call: ToolCallRow, *, countdown: float | None = None,
            producer: Any = None) -> None:
    """Send the message that makes a worker run ``call``. Raises if the broker is unreachable.

    Retries the connection briefly and then gives up, so ``call_tool`` never hangs on a dead
    broker: the caller turns the error into a "did not run" record or leaves the call to the
    republisher. ``producer``: a kombu producer to send with (``publish_many`` passes one that
    is batching).
    """
    settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
    effect = EffectClass(call.effect)
    name = task_name_for(effect)
    options: dict[str, Any] = {
        "queue": RETRYING_QUEUE if effect.retrying else SINGLE_ATTEMPT_QUEUE,
        "retry": True,
        "retry_policy": {
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": settings.publish_timeout_seconds / 4,
            "interval_max": settings.publish_timeout_seconds / 4,
        },
        # Shown by Flower and worker logs instead of the generic task name.
        "shadow": f"{name}[{call.tool}]",
    }
    if countdown:
        options["countdown"] = countdown
    if call.expires_at is not None:
        options["expires"] = datetime.fromtimestamp(call.expires_at, tz=UTC)
    if call.time_limit:
        options["time_limit"] = call.time_limit
        options["soft_time_limit"] = soft_limit(call.time_limit)
    app.send_task(name, args=[call.key], producer=producer, **options)


def publish_many(app: Celery, calls: Sequence[ToolCallRow]) -> None:
    """Send the messages of ``calls`` in one Redis round trip; raises if that failed.

    kombu's publish batch (``Producer.batch``, kombu 5.7) buffers the messages' ``LPUSH``
    commands and sends them as one pipeline when the batch ends. A batch that fails leaves it
    unknown which messages Redis took, like a publish whose reply was lost: the caller ends
    the calls "did not run" with a compare-and-set, which loses to a worker's claim.
    """
    with app.producer_or_acquire() as producer:
        # Room for every command in one flush (kombu would flush a full batch early).
        with producer.batch(max_size=max(16, 4 * len(calls))):
            for call in calls:
                publish(app, call, producer=producer)


def soft_limit(time_limit: float) -> float:
    """When the tool is warned (``SoftTimeLimitExceeded``) before the hard kill at the limit."""
    return max(time_limit * 0.8, time_limit - 5.0)
