"""Delivering webhooks from the worker's main process, never from a slot a tool call could use.

The message on ``dex.webhooks`` names a delivery (``store/webhooks.py`` wrote its row and body
in the transaction that made the event; ``broker/webhooks.py`` publishes it after the commit).
No pool slot ever takes one: the Celery consumer does not listen on that queue
(``celery_app.consume_queues``). A :class:`Sender`, started by ``worker_ready`` in the main
process of every ``dex-tasks worker`` (whatever its pool, compose included), takes them:

* a consumer thread (kombu's :class:`~kombu.mixins.ConsumerMixin`, reconnecting through Redis
  outages) receives each message, acknowledges it and hands the delivery to
* a sender thread running an asyncio loop with one :class:`httpx.AsyncClient`, at most
  ``DEX_WEBHOOK_CONCURRENCY`` requests at once. Every attempt has a total deadline,
  ``DEX_WEBHOOK_TIMEOUT_SECONDS`` for connecting, sending and reading the whole answer
  (``asyncio.timeout`` around the request, not httpx's per-read timeout, which a receiver that
  trickles a byte at a time never trips).

A failed attempt (connection refused, the deadline, a non-2xx answer) is tried again after
Celery's own backoff (``DEX_WEBHOOK_BACKOFF_SECONDS`` doubled per attempt with full jitter, up
to ``DEX_WEBHOOK_BACKOFF_MAX_SECONDS``), waiting in the loop, not in a slot, until
``DEX_WEBHOOK_MAX_ATTEMPTS`` attempts (counted on the row) have failed and the row is
``failed``. Each attempt is counted on its row (``dex-tasks webhooks``) and in
``dex_webhook_deliveries_total{outcome}``.

At least once: the row is the record, not the message. A row already ``delivered`` (or
``failed``) is not sent again, so a duplicate message costs nothing; a delivery whose worker
went away (between the message's acknowledgement and its last attempt) stays ``pending`` and
beat's ``republish_webhooks`` sweep sends it again. The one window left is a worker lost
between the receiver's 2xx and the row's update, after which the receiver gets the same event
id again (``Dex-Event-Id``) and drops it. Nothing here touches a call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any

import httpx
from celery import Celery
from celery.utils.time import get_exponential_backoff_interval
from kombu.connection import Connection
from kombu.mixins import ConsumerMixin

from dex_tasks.broker.celery_app import WEBHOOK_QUEUE, broker_queue
from dex_tasks.broker.metrics import count_webhook
from dex_tasks.settings import DexSettings
from dex_tasks.store import webhooks as outbox
from dex_tasks.webhooks import EVENT_HEADER, EVENT_ID_HEADER, SIGNATURE_HEADER, sign
from dex_tasks.worker.runtime import Runtime, runtime

log = logging.getLogger("dex_tasks.worker.webhooks")

# How long the consumer waits for a free sending slot before it looks at ``stopped`` again.
_INTAKE_POLL_SECONDS = 0.5


class Sender:
    """The webhook sender of one worker's main process: a consumer thread and an asyncio loop
    thread (see the module's doc). :meth:`start` once, :meth:`stop` at shutdown."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
        self.loop = asyncio.new_event_loop()
        # The consumer takes a message only when a slot is free: a receiver that hangs holds
        # at most DEX_WEBHOOK_CONCURRENCY messages here; the rest wait in Redis.
        self.intake = threading.BoundedSemaphore(self.settings.webhook_concurrency)
        self.stopped = threading.Event()
        self.in_flight: set[str] = set()
        self._sending: asyncio.Semaphore | None = None
        self._client: httpx.AsyncClient | None = None
        self._loop_thread = threading.Thread(target=self._run_loop, name="dex-webhook-sender",
                                             daemon=True)
        self._consumer = _Consumer(app.connection_for_read(), self)
        self._consumer_thread = threading.Thread(target=self._consumer.run,
                                                 name="dex-webhook-consumer", daemon=True)

    def start(self) -> None:
        self._loop_thread.start()
        self._consumer_thread.start()

    def stop(self, wait: float = 2.0) -> None:
        """Stop taking messages and sending. Deliveries not finished stay ``pending`` in the
        store, for the republish sweep."""
        self.stopped.set()
        self._consumer.should_stop = True
        self._consumer_thread.join(wait)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(wait)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def take(self, delivery_id: str) -> bool:
        """Hand ``delivery_id`` to the loop (called by the consumer thread; blocks while every
        sending slot is busy). False when the sender is stopping."""
        while not self.intake.acquire(timeout=_INTAKE_POLL_SECONDS):
            if self.stopped.is_set():
                return False
        self.submit(self.deliver(delivery_id))
        return True

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def deliver(self, delivery_id: str) -> str:
        """Every attempt of one delivery until it is delivered, failed or not ours to send;
        returns the last outcome. Holds an intake slot until its first attempt has ended."""
        holding = True
        try:
            if delivery_id in self.in_flight:  # already on its way in this process
                return "skipped"
            self.in_flight.add(delivery_id)
            try:
                while True:
                    outcome, attempts = await self.attempt(delivery_id)
                    if holding:
                        holding = False
                        self.intake.release()
                    if outcome != "retried":
                        return outcome
                    await asyncio.sleep(get_exponential_backoff_interval(
                        self.settings.webhook_backoff_seconds, attempts - 1,
                        self.settings.webhook_backoff_max_seconds, True))
            finally:
                self.in_flight.discard(delivery_id)
        except Exception:
            log.exception("webhook delivery stopped; the republish sweep sends it again",
                          extra={"action": "webhook_error", "delivery_id": delivery_id})
            return "error"
        finally:
            if holding:
                self.intake.release()

    async def attempt(self, delivery_id: str) -> tuple[str, int]:
        """One attempt: the outcome (``delivered``, ``failed``, ``retried``, ``skipped``) and
        the row's attempts after it."""
        rt = runtime(self.app)
        row = await asyncio.to_thread(outbox.get_delivery, rt.store, delivery_id)
        if row is None or row["status"] != outbox.PENDING:
            await asyncio.to_thread(_count, rt, "skipped")
            return "skipped", 0
        attempts = int(row["attempts"]) + 1
        final = attempts >= self.settings.webhook_max_attempts
        status_code, error = await self.post(row)
        ok = status_code is not None and 200 <= status_code < 300
        await asyncio.to_thread(outbox.record_attempt, rt.store, delivery_id, ok=ok,
                                final=final, status_code=status_code, error=error)
        outcome = "delivered" if ok else ("failed" if final else "retried")
        await asyncio.to_thread(_count, rt, outcome)
        log.info("webhook attempt", extra={
            "action": "webhook_" + outcome, "event": row["event"], "event_id": row["event_id"],
            "delivery_id": delivery_id, "status_code": status_code, "error": error,
            "attempt": attempts})
        return outcome, attempts

    async def post(self, row: dict[str, Any]) -> tuple[int | None, str | None]:
        """POST one delivery within its total deadline: (status code, error)."""
        settings = self.settings
        secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
        if not secret:
            return None, "DEX_WEBHOOK_SECRET is not set on this worker: nothing is sent unsigned"
        body = row["payload"].encode()
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body),
                   EVENT_ID_HEADER: row["event_id"], EVENT_HEADER: row["event"],
                   "User-Agent": "dex-tasks-webhooks"}
        deadline = settings.webhook_timeout_seconds
        if self._client is None:
            # Made in the loop, once: building one loads the TLS trust store (~100 ms), and a
            # shared client keeps connections to a receiver alive between deliveries.
            self._client = httpx.AsyncClient(timeout=deadline)
            self._sending = asyncio.Semaphore(settings.webhook_concurrency)
        assert self._sending is not None
        async with self._sending:
            try:
                # The whole request, answer included: httpx's timeout bounds each read only.
                async with asyncio.timeout(deadline):
                    response = await self._client.post(row["url"], content=body,
                                                        headers=headers)
            except TimeoutError:
                return None, f"no complete answer within DEX_WEBHOOK_TIMEOUT_SECONDS={deadline:g}"
            except httpx.HTTPError as err:
                return None, f"{type(err).__name__}: {err}"[:500]
        if 200 <= response.status_code < 300:
            return response.status_code, None
        return response.status_code, f"HTTP {response.status_code}: {response.text[:200]}"


class _Consumer(ConsumerMixin):  # type: ignore[misc]
    """kombu's reconnecting consumer of ``dex.webhooks``, feeding a :class:`Sender`."""

    def __init__(self, connection: Connection, sender: Sender) -> None:
        self.connection = connection
        self.sender = sender

    def get_consumers(self, consumer: Any, channel: Any) -> list[Any]:
        return [consumer(queues=[broker_queue(WEBHOOK_QUEUE)], callbacks=[self.on_message],
                         accept=["json"], prefetch_count=1)]

    def on_message(self, body: Any, message: Any) -> None:
        try:
            self._take(body, message)
        except Exception:  # a bad message must not stop the consumer
            log.exception("webhook message not taken; the republish sweep sends it again",
                          extra={"action": "webhook_error"})

    def _take(self, body: Any, message: Any) -> None:
        delivery_id = _delivery_id(body, message)
        if delivery_id is None:
            log.warning("webhook message without a delivery id dropped",
                        extra={"action": "webhook_bad_message"})
            message.ack()
            return
        # Acknowledged before it is sent: from here the row is the record, and a delivery
        # this process does not finish is sent again by the republish sweep.
        if self.sender.take(delivery_id):
            message.ack()
        else:
            message.requeue()


def _delivery_id(body: Any, message: Any) -> str | None:
    """The delivery a message names: a Celery task message (protocol 2, as
    ``broker/webhooks.publish`` sends) whose first argument and task id are the delivery id."""
    if isinstance(body, (list, tuple)) and body and isinstance(body[0], (list, tuple)):
        if body[0] and isinstance(body[0][0], str):
            return str(body[0][0])
    task_id = (message.headers or {}).get("id")
    return task_id if isinstance(task_id, str) else None


def _count(rt: Runtime, outcome: str) -> None:
    try:
        count_webhook(rt.redis, outcome)
    except Exception:  # noqa: BLE001 - a metric never fails a delivery
        log.warning("webhook metric not counted", extra={"action": "webhook_metric_error"})


_sender: Sender | None = None


def start(app: Celery) -> Sender:
    """Start this process's sender for ``app`` (the worker's main process, at ``worker_ready``)."""
    global _sender
    _sender = Sender(app)
    _sender.start()
    return _sender


def stop() -> None:
    """Stop this process's sender, if one was started."""
    if _sender is not None:
        _sender.stop()
