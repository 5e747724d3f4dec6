"""Celery signal handlers, all in one place. Each logs instead of raising.

* ``worker_process_init``: a forked child drops the connections it inherited.
* ``worker_ready``: the main process starts renewing the leases of the calls its children run.
  Renewing from the main process, not the child, keeps leases alive while a tool holds the GIL
  or the machine is loaded; a child that dies stops being in ``active_requests`` and its lease
  runs out. It also starts announcing the worker in Redis (``routing.Presence``): the tools it
  serves and the messages it holds, and the webhook sender (``webhooks.Sender``), which
  delivers from the main process so that no delivery takes a pool slot.
* ``worker_shutdown``: stop renewing, announcing and sending.
* ``task_revoked``: a message that expired in the queue ends its call "did not run".
* ``task_prerun`` / ``task_postrun``, on the threads pool only: the clock of each call's hard
  time limit (``threadpool.Watchdog``), which Celery does not keep there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from celery import Celery, signals
from celery.worker import state as worker_state

from dex_tasks.broker.celery_app import RUN_RETRYING, RUN_SINGLE_ATTEMPT
from dex_tasks.broker.redis_clients import redis_client
from dex_tasks.broker.routing import Presence
from dex_tasks.states import CallStatus
from dex_tasks.store import bounded_statements
from dex_tasks.worker import spans as worker_spans
from dex_tasks.worker import webhooks
from dex_tasks.worker.endings import did_not_run
from dex_tasks.worker.leased import handle_lost
from dex_tasks.worker.runtime import current_owner, reset_runtime, runtime
from dex_tasks.worker.threadpool import Watchdog, Watched

log = logging.getLogger("dex_tasks.worker.hooks")

_CALL_TASKS = frozenset({RUN_RETRYING, RUN_SINGLE_ATTEMPT})
# How soon the threads pool's watchdog looks again at a call whose limit passed before it ran.
RECHECK_SECONDS = 0.2


class LeaseRenewer(threading.Thread):
    """Renews the leases of the calls this worker's children are running: those of the
    single-attempt path in the store (``kind="store"``) or the retrying path's runs in Redis
    (``kind="redis"``). One thread per kind: a store that stalls (another process holding
    SQLite's write lock for seconds) must not keep the Redis leases from renewing, which the
    reaper judges on Redis's clock, nor an unreachable Redis the store's."""

    def __init__(self, app: Celery, kind: str = "store") -> None:
        super().__init__(name=f"dex-lease-renewer-{kind}", daemon=True)
        self.app = app
        self.kind = kind
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
                                  extra={"action": "lease_renew_error", "kind": self.kind})
                wait = self.RETRY_AFTER_FAILURE

    def renew_once(self) -> int:
        """Extend every active call's lease of this renewer's kind to ``lease_seconds`` from
        now, on the store's clock or Redis's (this machine's clock plays no part)."""
        rt = runtime(self.app)
        # The retrying path's attempts are leased in Redis, the others in the store.
        retrying = self.kind == "redis"
        by_host: dict[str, list[str]] = {}
        for request in list(worker_state.active_requests):
            # ``type`` is the registered task name; ``name`` is the shadow name that publish()
            # gives each message ("dex.call_tool[lookup_order]") and never matches.
            if request.type in _CALL_TASKS and request.args and (
                    (request.type == RUN_RETRYING) == retrying):
                by_host.setdefault(request.hostname, []).append(request.args[0])
        if not by_host:
            return 0
        if retrying:
            return sum(rt.runs.renew(f"{host}:", keys, rt.settings.lease_seconds)
                       for host, keys in by_host.items())
        # Bounded: a renewal waiting on a row lock (a vanished host's session, a call of ours
        # mid-ending) fails in seconds and is tried again, instead of queueing for minutes.
        with bounded_statements(rt.settings.sweep_statement_timeout_seconds,
                                rt.settings.sweep_lock_timeout_seconds):
            return sum(rt.store.renew_leases(f"{host}:", keys, rt.settings.lease_seconds)
                       for host, keys in by_host.items())


_renewers: list[LeaseRenewer] = []
_presence: Presence | None = None


def install(app: Celery, tools: Iterable[str] = (), *, pool: str = "prefork",
            concurrency: int = 1) -> None:
    """Connect the handlers for ``app``'s worker (called by ``dex-tasks worker``), which
    serves ``tools`` on ``pool`` with ``concurrency`` slots."""
    served = sorted(tools)
    worker_spans.install(app)  # OpenTelemetry: a span per delivery (when it is configured)

    @signals.worker_process_init.connect(weak=False)
    def _child_started(**_: Any) -> None:
        reset_runtime()

    @signals.worker_ready.connect(weak=False)
    def _worker_ready(sender: Any = None, **_: Any) -> None:
        global _presence
        _renewers[:] = [LeaseRenewer(app, "store"), LeaseRenewer(app, "redis")]
        for renewer in _renewers:
            renewer.start()
        settings = runtime(app).settings
        _presence = Presence(redis_client(settings, socket_timeout=5, socket_connect_timeout=5),
                             str(getattr(sender, "hostname", "?")), served, pool, concurrency,
                             settings.worker_heartbeat_seconds)
        try:
            # Announced before the worker says it is ready: from then on its tools count as
            # served (the republisher and the queue deadline look at that).
            _presence.beat_once()
        except Exception as err:  # noqa: BLE001 - Redis down: the thread keeps trying
            log.warning("first worker heartbeat failed: %s", err,
                        extra={"action": "heartbeat_error"})
        _presence.start()
        try:
            webhooks.start(app)
        except Exception:  # calls still run; deliveries wait for the republish sweep
            log.exception("webhook sender not started", extra={"action": "webhook_error"})
        log.info("worker ready", extra={"action": "worker_ready", "pool": pool,
                                        "tools": len(served)})

    @signals.worker_shutdown.connect(weak=False)
    def _worker_shutdown(**_: Any) -> None:
        for renewer in _renewers:
            renewer.stopped.set()
        if _presence is not None:
            _presence.stopped.set()
        webhooks.stop()

    if pool == "threads":
        _watch_time_limits(app)

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


def _watch_time_limits(app: Celery) -> None:
    """Keep each call's hard time limit on the threads pool (see ``threadpool.py``)."""

    def expired(entry: Watched) -> None:
        rt = runtime(app)
        reason = (f"the tool was stopped by its hard time limit ({entry.limit}s); on the "
                  "threads pool its thread cannot be killed and was abandoned")
        status = handle_lost(rt, entry.key, entry.owner, reason, republish=True)
        if status is None:
            call = rt.store.get_call(entry.key)
            if call is not None and call.status == CallStatus.QUEUED.value:
                # The limit passed before this thread even claimed the call (a slow store):
                # keep watching, so that a tool it starts now is still stopped.
                watchdog.watch(entry.task_id, entry.key, entry.owner, RECHECK_SECONDS)
            return
        log.warning("time limit passed, thread abandoned", extra={
            "action": "thread_abandoned", "key": entry.key, "owner": entry.owner,
            "status": status.value})

    watchdog = Watchdog(expired)
    watchdog.start()

    @signals.task_prerun.connect(weak=False)
    def _started(sender: Any = None, task_id: str = "", args: Any = None, **_: Any) -> None:
        # Runs in the pool thread that is about to run the call, so the owner id is its own.
        try:
            limit = (getattr(sender.request, "timelimit", None) or (None, None))[0]
            if sender.name in _CALL_TASKS and limit and args:
                watchdog.watch(task_id, args[0], current_owner(sender.request.hostname),
                               float(limit))
        except Exception:
            log.exception("could not watch a call's time limit",
                          extra={"action": "time_limit_error"})

    @signals.task_postrun.connect(weak=False)
    def _returned(task_id: str = "", args: Any = None, **_: Any) -> None:
        entry = watchdog.forget(task_id)
        if entry is not None and entry.expired:
            # Its outcome was recorded at the limit; the guarded transition refused whatever
            # the thread tried to record after that.
            log.info("abandoned thread returned", extra={
                "action": "abandoned_thread_returned", "key": entry.key, "owner": entry.owner})
