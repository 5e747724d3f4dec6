"""Celery signal handlers, all in one place. Each logs instead of raising.

* ``worker_process_init``: a forked child drops the connections it inherited.
* ``worker_ready``: the main process starts renewing the leases of the calls its children run.
  Renewing from the main process, not the child, keeps leases alive while a tool holds the GIL
  or the machine is loaded; a child that dies stops being in ``active_requests`` and its lease
  runs out.
* ``worker_shutdown``: stop renewing.
* ``task_revoked``: a message that expired in the queue ends its call "did not run".
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, signals
from celery.worker import state as worker_state

from dex_tasks.celery_app import RUN_RETRYING, RUN_SINGLE_ATTEMPT
from dex_tasks.execution import did_not_run, reset_runtime, runtime

log = logging.getLogger("dex_tasks.hooks")

_CALL_TASKS = frozenset({RUN_RETRYING, RUN_SINGLE_ATTEMPT})


class LeaseRenewer(threading.Thread):
    """Renews the leases of the calls this worker's children are running."""

    def __init__(self, app: Celery) -> None:
        super().__init__(name="dex-lease-renewer", daemon=True)
        self.app = app
        self.stopped = threading.Event()

    # After a failed renewal (the store unreachable for longer than its retries last), try
    # again this soon rather than a whole interval later: the reaper gives live workers about
    # a second to renew once the store answers again (see ``sweeps.reap_expired_leases``).
    RETRY_AFTER_FAILURE = 0.25

    def run(self) -> None:
        rt = runtime(self.app)
        interval = max(0.2, rt.settings.lease_seconds / 3)
        wait = interval
        while not self.stopped.wait(wait):
            try:
                self.renew_once()
                wait = interval
            except Exception:
                if wait == interval:
                    log.exception("lease renewal failed",
                                  extra={"action": "lease_renew_error"})
                wait = self.RETRY_AFTER_FAILURE

    def renew_once(self) -> int:
        """Extend every active call's lease to ``lease_seconds`` from now, on the store's
        clock (this machine's clock plays no part)."""
        rt = runtime(self.app)
        by_host: dict[str, list[str]] = {}
        for request in list(worker_state.active_requests):
            # ``type`` is the registered task name; ``name`` is the shadow name that publish()
            # gives each message ("dex.call_tool[lookup_order]") and never matches.
            if request.type in _CALL_TASKS and request.args:
                by_host.setdefault(request.hostname, []).append(request.args[0])
        return sum(rt.store.renew_leases(f"{host}:", keys, rt.settings.lease_seconds)
                   for host, keys in by_host.items())


_renewer: LeaseRenewer | None = None


def install(app: Celery) -> None:
    """Connect the handlers for ``app``'s worker (called by ``dex-tasks worker``)."""

    @signals.worker_process_init.connect(weak=False)
    def _child_started(**_: Any) -> None:
        reset_runtime()

    @signals.worker_ready.connect(weak=False)
    def _worker_ready(**_: Any) -> None:
        global _renewer
        _renewer = LeaseRenewer(app)
        _renewer.start()
        log.info("worker ready", extra={"action": "worker_ready"})

    @signals.worker_shutdown.connect(weak=False)
    def _worker_shutdown(**_: Any) -> None:
        if _renewer is not None:
            _renewer.stopped.set()

    @signals.task_revoked.connect(weak=False)
    def _revoked(sender: Any = None, request: Any = None, expired: bool = False,
                 **_: Any) -> None:
        # ``request`` is a task Context here, not a Request: it has ``task`` (the real task
        # name) and ``args`` but no ``name``; the sender is the task itself.
        name = getattr(sender, "name", None) or getattr(request, "task", None)
        if not expired or request is None or name not in _CALL_TASKS:
            return
        try:
            rt = runtime(app)
            call = rt.store.get_call(request.args[0])
            if call is not None:
                did_not_run(rt.store, call, "it expired in the queue before a worker started it")
        except Exception:
            log.exception("could not record an expired call", extra={"action": "expire_error"})
