"""The Celery app's configuration: JSON only, the queues, no result backend, and publishing.

This module knows no task bodies: an app built here can send calls (``DexClient``, beat, the
sweeps) but runs nothing. The worker registers the task kinds on its own app where it is built
(``main_process.worker_app``), so the layers stay one-way: configuration below execution.

The message of a call carries its idempotency key and nothing else: the store holds the
arguments, the policy snapshot and the status, so a message can be republished at any time and
a stale or duplicate one can do no harm.

Each call goes to its tool's queue (``routing.queue_for``); a worker consumes the queues of the
tools it serves. The one periodic job that needs tool code (``reconcile_unknown``, the tools'
own checkers) goes to the workers on a queue of its own; beat runs every other sweep itself.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu.entity import Exchange, Queue
from kombu.exceptions import OperationalError
from kombu.utils.uuid import uuid

from dex_tasks.broker.redis_clients import broker_options, keepalive_options
from dex_tasks.broker.routing import queue_for
from dex_tasks.policy import EffectClass
from dex_tasks.settings import DexSettings
from dex_tasks.store.models import ToolCallRow
from dex_tasks.tracing import message_headers

# The workers' sweep job (reconcile_unknown), on a queue every worker consumes.
RECONCILE_QUEUE = "dex.reconcile"
WEBHOOK_QUEUE = "dex.webhooks"
RUN_RETRYING = "dex.call_tool"
RUN_SINGLE_ATTEMPT = "dex.call_single_attempt_tool"
SWEEP = "dex.sweep"


def create_app(settings: DexSettings, *, publisher: bool = False) -> Celery:
    """A Celery app configured for dex-tasks; it sends tasks by name and registers none.

    ``publisher`` is for apps that only send calls (``DexClient``): they get the short socket
    timeouts of a publish. Every app's transport reuses its Redis client per channel (see
    ``transport.py``).
    """
    # Sentinel and TLS: the same parsing as every other Redis client (see redis_clients.py).
    broker = broker_options(settings)
    app = Celery("dex_tasks", broker=settings.redis_url, set_as_current=False)
    transport = {
        "visibility_timeout": settings.visibility_timeout_seconds,
        "socket_connect_timeout": settings.publish_timeout_seconds,
        "socket_timeout": max(5.0, settings.publish_timeout_seconds),
        # An app that only publishes splits DEX_PUBLISH_TIMEOUT_SECONDS over publish()'s two
        # tries: with a 5 s socket timeout, a pooled connection into a silent network made
        # call_tool wait 2 x 5 s (issue 19, P4). Workers keep the longer one for consuming.
        **({"socket_connect_timeout": settings.publish_timeout_seconds / 3,
            "socket_timeout": settings.publish_timeout_seconds / 3} if publisher else {}),
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": 10,
        # No message priorities: kombu's default listens on four priority lists per queue,
        # so a worker's BRPOP named four keys per tool (2,000 for an MCP server's 500 tools),
        # built and sent again after every message. With one step a queue is one list (the
        # one a message without a priority always went to).
        "priority_steps": [0],
        **broker.pop("broker_transport_options"),
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
        # Calls name their tool's queue when published (publish()); nothing else is sent but
        # the reconcile job. A worker's own list of queues is set where it is built
        # (main_process.worker_app).
        task_default_queue=RECONCILE_QUEUE,
        task_queues=[broker_queue(RECONCILE_QUEUE)],
        task_routes={SWEEP: {"queue": RECONCILE_QUEUE}},
        # A worker takes a message only when a pool slot is free (Redis only, Celery 5.6+).
        # A message it had fetched ahead would wait behind its busy (or hung) slots while
        # other workers idle, and would go down with it if it died: SIGKILL runs no hook, so
        # only the visibility timeout (an hour) would hand it back.
        worker_prefetch_multiplier=1,
        worker_disable_prefetch=True,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        # Workers keep reconnecting through a long Redis outage instead of exiting after
        # about 100 tries; publishing has its own short retry policy (see publish()).
        broker_connection_max_retries=None,
        # Survives Redis going away while messages are unacked (see DexConsumer).
        worker_consumer="dex_tasks.worker.main_process:DexConsumer",
        broker_connection_timeout=settings.publish_timeout_seconds,
        broker_pool_limit=10,
        worker_hijack_root_logger=False,
        # No task events unless asked (`dex-tasks worker -E`), as in plain Celery: each event
        # is a Redis publish per state change, several per call, which a deployment without
        # a monitor pays for nothing. Flower turns them on by itself (its enable_events
        # broadcast); `celery events` needs the workers started with -E. The sweep task opts
        # out even then (main_process.register_tasks), so beat's sweeps do not crowd the lists.
        worker_send_task_events=False,
        # No task-sent events: Celery puts the registered name in them, not the shadow name
        # that says which tool a message runs, and its event state lets a sent event that
        # arrives after the worker's events (always for a retry's message, which the child
        # sends while the worker is already reporting) overwrite the task's name, so Flower
        # would list "dex.call_tool" instead of "dex.call_tool[lookup_order]". Flower lists a
        # call from the moment a worker receives it, and shows queue lengths on its Broker page.
        task_send_sent_event=False,
        enable_utc=True,
        **broker,
    )
    app.dex_settings = settings  # type: ignore[attr-defined]
    app.dex_producer = HeldProducer()  # type: ignore[attr-defined]
    app.dex_sending = None  # type: ignore[attr-defined]  # _sending() fills it in
    return app


def consume_queues(app: Celery, tools: Iterable[str]) -> list[str]:
    """Make ``app`` (a worker's) consume the queues of ``tools`` and the reconcile queue.

    Set here rather than with ``-Q``, which splits on commas (a tool name may hold one).
    Returns the queue names.
    """
    # Not the webhook queue: deliveries never take a slot a tool call could use. The worker's
    # main process sends them itself (worker/webhooks.py), outside the pool.
    names = [*sorted({queue_for(name) for name in tools}), RECONCILE_QUEUE]
    app.conf.task_queues = [broker_queue(name) for name in names]
    return names


def broker_queue(name: str) -> Queue:
    """The kombu queue ``name`` as every dex-tasks consumer and publisher declares it."""
    # Bound to an exchange of its own name with its name as the key, as the publisher's
    # send_task(queue=name) declares it. A bare Queue(name) would be bound to the default
    # exchange (dex.reconcile) with the default key: every message sent there (beat's
    # reconcile job) would then be copied into every tool queue as well.
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def task_name_for(effect: EffectClass) -> str:
    """The task kind that runs calls of this effect class."""
    return RUN_RETRYING if effect.retrying else RUN_SINGLE_ATTEMPT


def shadow_name(task_name: str, tool: str) -> str:
    """The name a call's message shows in place of its task kind's (Flower, worker logs,
    spans): ``dex.call_tool[lookup_order]``."""
    return f"{task_name}[{tool}]"


def tool_of_shadow(shadow: str | None) -> str | None:
    """The tool a message's :func:`shadow_name` names, or None for any other name."""
    if shadow and shadow.endswith("]"):
        task_name, bracket, tool = shadow[:-1].partition("[")
        if bracket and tool and task_name in (RUN_RETRYING, RUN_SINGLE_ATTEMPT):
            return tool
    return None


def publish(app: Celery, call: ToolCallRow, *, countdown: float | None = None,
            producer: Any = None) -> None:
    """Send the message that makes a worker run ``call``. Raises if the broker is unreachable.

    Retries the connection briefly and then gives up, so ``call_tool`` never hangs on a dead
    broker: the caller turns the error into a "did not run" record or leaves the call to the
    republisher. ``producer``: a kombu producer to send with (``publish_many`` passes one that
    is batching).

    The message is what ``app.send_task`` sends for these options (``tests/test_publish.py``
    compares the two), built and sent with the two calls ``send_task`` makes itself, Celery's
    ``app.amqp.create_task_message`` and ``app.amqp.send_task_message``. What ``send_task``
    does around them is for options a call never has, and cost a third of a publish's CPU
    (issue 29): the task routes looked up for a queue given by name, the registered task's
    default options merged in (a call's come from its row), the result backend told about a
    task whose result nobody stores, and the arguments' text built by ``saferepr`` for a list
    of one key.
    """
    sending = _sending(app)
    name = task_name_for(EffectClass(call.effect))
    task_id = uuid()
    root_id = parent_id = None
    parent = app.current_worker_task
    if parent is not None:  # sent from a task (a sweep, a lost attempt's retry)
        root_id = parent.request.root_id or parent.request.id
        parent_id = parent.request.id
    expires = (datetime.fromtimestamp(call.expires_at, tz=UTC)
               if call.expires_at is not None else None)
    args = [call.key]
    message = sending.create_message(
        task_id, name, args, {}, countdown or None, None, None, None, expires, 0, None,
        None, None, app.thread_oid, call.time_limit or None,
        soft_limit(call.time_limit) if call.time_limit else None,
        sending.sent_event, root_id, parent_id,
        # Shown by Flower and worker logs instead of the generic task name.
        shadow_name(name, call.tool), None,
        origin=sending.origin(), ignore_result=None, argsrepr=repr(args), kwargsrepr="{}")
    options: dict[str, Any] = {
        "queue": queue_for(call.tool),
        "retry": True,
        "retry_policy": sending.retry_policy,
        # Nothing to declare: the queue's exchange is direct, so Celery sends the message by
        # the default exchange straight onto the queue's Redis list (kombu's _put), which no
        # declaration is needed for (a worker declares the queues it consumes). Left to
        # declare, kombu copies the queue and its exchange on every publish only to find
        # them declared already (its _maybe_declare drops the bound copy it makes): about a
        # tenth of publish()'s CPU.
        "declare": [],
    }
    if call.trace_context is not None:  # OpenTelemetry: the trace joins the agent's
        options["headers"] = message_headers(call)
    if call.expires_at is not None:
        # The message's own time to live, as send_task sets it (AMQP brokers drop it then).
        options["expiration"] = max(0.0, call.expires_at - time.time())
    with _sender(app, producer) as sender:
        connection = sender.connection
        try:
            sending.send_message(sender, name, message, **options)
        except OperationalError:
            raise
        except (*connection.recoverable_connection_errors,
                *connection.recoverable_channel_errors) as err:
            # As send_task raises them: kombu's error, whatever the transport's was.
            raise OperationalError(str(err)) from err


@dataclass
class _Sending:
    """What each publish of an app reads from it, read at its first publish
    (:func:`_sending`): Celery's two calls behind ``send_task``, whose every read from
    ``app.amqp`` goes through a kombu cached property that takes a lock; whether a task-sent
    event is made, a lookup through Celery's layered settings (read once, as Celery's own
    ``send_task_message`` reads the settings it uses when it is first made); and the retry
    policy of a publish. Together about 4 µs of a publish (issue 29)."""

    create_message: Callable[..., Any]
    send_message: Callable[..., Any]
    sent_event: bool
    retry_policy: dict[str, Any]
    _origin: tuple[int, str] = (0, "")

    def origin(self) -> str:
        """The message's ``origin``, as Celery writes it when given none (``anon_nodename``:
        this process's id at the host's name, which Celery looks up once per process), made
        once per process rather than per message."""
        pid, origin = self._origin
        if pid != os.getpid():
            pid, origin = self._origin = os.getpid(), anon_nodename()
        return origin


def _sending(app: Celery) -> _Sending:
    sending: _Sending | None = app.dex_sending  # type: ignore[attr-defined]
    if sending is None:
        settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
        amqp = app.amqp
        # Shared by every publish of the app: Celery copies it (merged with its default
        # policy) before kombu sees it.
        sending = app.dex_sending = _Sending(  # type: ignore[attr-defined]
            amqp.create_task_message, amqp.send_task_message,
            bool(app.conf.task_send_sent_event), {
                "max_retries": 1,
                "interval_start": 0,
                "interval_step": settings.publish_timeout_seconds / 4,
                "interval_max": settings.publish_timeout_seconds / 4,
            })
    return sending


class HeldProducer:
    """The producer an app keeps between its publishes (``app.dex_producer``).

    Celery's producer pool hands a producer out per publish and takes it back after: a
    connection checked out of the pool, the producer bound to its channel, and both undone on
    release, about a fifth of a publish's CPU (issue 29). An agent publishes one call after
    another from one thread, so this one is held instead, by whichever publish finds it free;
    one that finds it taken (another thread publishing) takes one from the pool as before.
    It comes from the app's pool, whose ``app.close()`` closes it with the rest. A publish that
    fails gives it back to the pool, which resets it; a forked child never uses its parent's
    (the socket is the parent's), it takes its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._producer: Any = None
        self._pid = os.getpid()

    @contextmanager
    def use(self, app: Celery) -> Iterator[Any]:
        """The held producer for one publish, or one from the pool while it is in use."""
        if not self._lock.acquire(blocking=False):
            with app.producer_or_acquire() as pooled:
                yield pooled
            return
        try:
            if self._pid != os.getpid():
                self._producer, self._pid = None, os.getpid()  # the parent's: left alone
            if self._producer is None:
                self._producer = app.producer_pool.acquire(block=True)
            try:
                yield self._producer
            except BaseException:
                failed, self._producer = self._producer, None
                failed.release()
                raise
        finally:
            self._lock.release()


def _sender(app: Celery, producer: Any) -> AbstractContextManager[Any]:
    """``producer`` if given, else the app's held one (:class:`HeldProducer`)."""
    if producer is not None:
        return nullcontext(producer)
    held: HeldProducer = app.dex_producer  # type: ignore[attr-defined]
    return held.use(app)


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
