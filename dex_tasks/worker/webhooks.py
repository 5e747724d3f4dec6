"""Delivering webhooks: one Celery task per delivery (event x URL), retried with backoff.

The message names a delivery (``store/webhooks.py`` wrote its row and body in the transaction
that made the event). The task is of the retrying kind: acknowledged late and requeued if its
worker is lost, retried on any failure (connection refused, timeout, a non-2xx answer) by
Celery's own ``autoretry_for`` with ``retry_backoff`` (``DEX_WEBHOOK_BACKOFF_SECONDS``, doubled
per attempt, full jitter), ``retry_backoff_max`` and ``max_retries``
(``DEX_WEBHOOK_MAX_ATTEMPTS`` - 1). Each attempt is counted on its row (``dex-tasks
webhooks``) and in ``dex_webhook_deliveries_total{outcome}``; after the last, the row is
``failed``.

At least once: a row already ``delivered`` (or ``failed``) is not sent again, so a duplicate
message (the republish sweep, a requeue) costs nothing; the one window left is a worker lost
between the receiver's 2xx and the row's update, after which the receiver gets the same event
id again (``Dex-Event-Id``) and drops it. Nothing here touches a call: a receiver that is down
never delays or fails one.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import httpx
from celery import Celery, Task

from dex_tasks.broker.metrics import count_webhook
from dex_tasks.broker.webhooks import DELIVER_WEBHOOK
from dex_tasks.settings import DexSettings
from dex_tasks.store import webhooks as outbox
from dex_tasks.webhooks import EVENT_HEADER, EVENT_ID_HEADER, SIGNATURE_HEADER, sign
from dex_tasks.worker.execution import runtime

log = logging.getLogger("dex_tasks.worker.webhooks")


class WebhookRetry(Exception):
    """An attempt that failed and will be tried again (Celery's autoretry acts on it)."""


def register(app: Celery) -> None:
    """Register the delivery task on a worker's app, with the settings' retry policy."""
    settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]

    @app.task(name=DELIVER_WEBHOOK, bind=True, shared=False, acks_late=True,
              reject_on_worker_lost=True, ignore_result=True, autoretry_for=(WebhookRetry,),
              retry_backoff=settings.webhook_backoff_seconds,
              retry_backoff_max=settings.webhook_backoff_max_seconds, retry_jitter=True,
              max_retries=settings.webhook_max_attempts - 1)
    def deliver_webhook(self: Task, delivery_id: str) -> None:
        deliver(self, delivery_id)


def deliver(task: Task, delivery_id: str) -> str:
    """One attempt of one delivery; returns its outcome (``delivered``, ``failed``,
    ``skipped``) or raises :class:`WebhookRetry` for another attempt."""
    rt = runtime(task.app)
    row = outbox.get_delivery(rt.store, delivery_id)
    if row is None or row["status"] != outbox.PENDING:
        _count(rt, "skipped")
        return "skipped"
    final = task.request.retries >= (task.max_retries or 0)
    status_code, error = _post(rt.settings, row)
    ok = status_code is not None and 200 <= status_code < 300
    outbox.record_attempt(rt.store, delivery_id, ok=ok, final=final, status_code=status_code,
                          error=error)
    outcome = "delivered" if ok else ("failed" if final else "retried")
    _count(rt, outcome)
    log.info("webhook attempt", extra={"action": "webhook_" + outcome, "event": row["event"],
                                        "event_id": row["event_id"], "delivery_id": delivery_id,
                                        "status_code": status_code, "error": error})
    if outcome == "retried":
        raise WebhookRetry(error or f"HTTP {status_code}")
    return outcome


def _post(settings: DexSettings, row: dict[str, Any]) -> tuple[int | None, str | None]:
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else ""
    if not secret:
        return None, "DEX_WEBHOOK_SECRET is not set on this worker: nothing is sent unsigned"
    body = row["payload"].encode()
    headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body),
               EVENT_ID_HEADER: row["event_id"], EVENT_HEADER: row["event"],
               "User-Agent": "dex-tasks-webhooks"}
    try:
        response = _http(settings.webhook_timeout_seconds).post(row["url"], content=body,
                                                                 headers=headers)
    except httpx.HTTPError as err:
        return None, f"{type(err).__name__}: {err}"[:500]
    if 200 <= response.status_code < 300:
        return response.status_code, None
    return response.status_code, f"HTTP {response.status_code}: {response.text[:200]}"


_clients: dict[tuple[int, float], httpx.Client] = {}
_clients_lock = threading.Lock()


def _http(timeout: float) -> httpx.Client:
    """This process's HTTP client (one per pid: a forked child makes its own). Building one
    loads the TLS trust store, which cost ~100 ms per delivery when made per request; a shared
    client also keeps connections to a receiver alive between deliveries."""
    key = (os.getpid(), timeout)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = httpx.Client(timeout=timeout)
        return client


def _count(rt: Any, outcome: str) -> None:
    try:
        count_webhook(rt.redis, outcome)
    except Exception:  # noqa: BLE001 - a metric never fails a delivery
        log.warning("webhook metric not counted", extra={"action": "webhook_metric_error"})
