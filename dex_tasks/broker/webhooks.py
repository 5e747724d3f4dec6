"""Publishing webhook deliveries: the store's outbox rows become Celery messages after commit.

``install`` wires a store to the settings (``DEX_WEBHOOK_URLS``, ``DEX_PUBLIC_URL``) and to a
publisher, so that every transaction that writes an approval event (``store/webhooks.py``)
sends its deliveries once it has committed. A message carries the delivery id only (the store
holds the body), has that id as its task id, and goes to ``dex.webhooks``, which every
worker's main process consumes outside its pool (``worker/webhooks.py``). A
publish that fails is logged and left to the republish sweep: it never fails or delays the
transaction that made the event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from celery import Celery

from dex_tasks.broker.celery_app import WEBHOOK_QUEUE
from dex_tasks.settings import DexSettings
from dex_tasks.store.base import StoreBase

log = logging.getLogger("dex_tasks.broker.webhooks")

__all__ = ["DELIVER_WEBHOOK", "WEBHOOK_QUEUE", "install", "publish"]

DELIVER_WEBHOOK = "dex.deliver_webhook"


def publish(app: Celery, delivery_ids: Sequence[str]) -> None:
    """Send one delivery message per id; raises if the broker is unreachable."""
    for delivery_id in delivery_ids:
        app.send_task(DELIVER_WEBHOOK, args=[delivery_id], task_id=delivery_id,
                      queue=WEBHOOK_QUEUE, retry=True,
                      retry_policy={"max_retries": 1, "interval_start": 0,
                                    "interval_step": 0.25, "interval_max": 0.25})


def install(store: StoreBase, settings: DexSettings, app: Callable[[], Celery]) -> None:
    """Make ``store`` write webhook events for ``settings`` and publish them with ``app()``
    (called on the first publish: a process that never writes an event builds no app)."""
    store.webhook_urls = settings.webhook_url_list()
    store.public_url = settings.public_url

    def after_commit(ids: Sequence[str]) -> None:
        try:
            publish(app(), ids)
        except Exception as err:  # noqa: BLE001 - the row stays pending; the sweep sends it
            log.warning("webhook publish failed; left for the republish sweep", extra={
                "action": "webhook_publish_failed", "deliveries": len(ids),
                "error": f"{type(err).__name__}: {err}"})

    store.publish_webhooks = after_commit
