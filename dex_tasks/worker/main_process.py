"""What runs in the worker's main process: loss handling, the consumer, task registration.

A child that is killed runs none of its own hooks, so the main process records the loss in
:class:`DexRequest`. :class:`DexConsumer` keeps the worker alive through Redis restarts.
``worker_app`` builds a worker's app: the configuration of ``celery_app.py`` plus the task
kinds of ``execution.py`` and the sweep task, registered here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import Celery, Task
from celery.worker.consumer import Consumer
from celery.worker.request import Request

from dex_tasks.broker.celery_app import (
    RUN_RETRYING,
    RUN_SINGLE_ATTEMPT,
    SWEEP,
    consume_queues,
    create_app,
)
from dex_tasks.errors import CallFailure
from dex_tasks.settings import DexSettings
from dex_tasks.states import CallStatus
from dex_tasks.worker import hooks
from dex_tasks.worker.endings import handle_lost_attempt
from dex_tasks.worker.execution import run_retrying, run_single_attempt
from dex_tasks.worker.retry import celery_retry_options
from dex_tasks.worker.runtime import owner_id, runtime
from dex_tasks.worker.sweeps import run_job
from dex_tasks.worker.task_states import failure

log = logging.getLogger("dex_tasks.worker.main_process")

# The endings a lost attempt's task-failed event reports (as the child's CallFailure would).
ENDED_BADLY = {CallStatus.FAILED.value, CallStatus.OUTCOME_UNKNOWN.value}


class DexRequest(Request):  # type: ignore[misc]
    """Celery request that records lost attempts from the worker's main process.

    ``on_failure`` here runs in the parent, also when the child was SIGKILLed
    (``WorkerLostError``) or killed by the hard time limit (``TimeLimitExceeded``), which the
    child itself can never report. It also runs for every ordinary task failure: a
    ``CallFailure`` is the body telling Celery that its call ended ``failed`` or
    ``outcome_unknown`` (already recorded), which is not a loss; Celery acknowledges it
    (``acks_on_failure``) and neither requeues nor retries it.

    For a lost attempt that ended its call (``outcome_unknown``, or ``failed`` when no attempt
    is left), the ``task-failed`` event carries the call's own ending, as the child's
    ``CallFailure`` would have: Celery would send ``repr()`` of billiard's
    ``ExceptionWithTraceback`` wrapper, which Flower shows as ``ExceptionWithTraceback()``.
    Only the event changes; Celery's handling of the loss (requeue, ack) is its own.
    """

    _ending: CallFailure | None = None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, TimeLimitExceeded):
            self._kill_child()
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded, SystemExit)):
            self._ending = self._ending or self._record_lost(exc)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._kill_child()
            self._ending = self._record_lost(TimeLimitExceeded(timeout))
        super().on_timeout(soft, timeout)

    def send_event(self, type: str, **fields: Any) -> None:
        if type == "task-failed" and self._ending is not None:
            fields["exception"] = repr(self._ending)
        super().send_event(type, **fields)

    def _kill_child(self) -> None:
        # Celery runs these hooks for a hard time limit *before* it terminates the child, so
        # without this the tool would run on while its call is already recorded as ended and,
        # on the retrying path, while its next attempt starts elsewhere. Kill it first.
        if self.worker_pid:
            try:
                kill_child(self.worker_pid)
            except Exception:
                log.exception("could not kill a timed-out child",
                              extra={"action": "kill_child_error", "pid": self.worker_pid})

    def _record_lost(self, exc: BaseException) -> CallFailure | None:
        """Record the loss in the store; the call's ending if it has ended failed or
        outcome_unknown (by this loss, or by whoever decided first)."""
        try:
            key = self.args[0]
            owner = owner_id(self.hostname, self.worker_pid) if self.worker_pid else None
            if owner is None:
                # We cannot tell which child ran it; the lease reaper will decide safely.
                return None
            if isinstance(exc, TimeLimitExceeded):
                reason = f"the tool was killed by its hard time limit ({exc.args[0]}s)"
            else:
                reason = f"the worker process running the tool was lost ({exc})"
            # On the retrying path Celery requeues the message itself, for a lost child
            # (reject_on_worker_lost) and for a hard time limit (acks_on_timeout=False), so no
            # new message is needed. Requeueing the message that was running also covers a
            # child killed after it recorded a retry but before it sent the retry's message.
            rt = runtime(self.task.app)
            handle_lost_attempt(rt, key, owner, reason, republish=False)
            call = rt.store.get_call(key)
        except Exception:
            log.exception("could not record a lost attempt", extra={"action": "lost_hook_error"})
            return None
        if call is None or call.status not in ENDED_BADLY:
            return None
        return failure(CallStatus(call.status), call.error)


class DexConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, made to survive Redis going away while messages are unacked.

    Seen with Celery/kombu 5.7 when Redis restarts while the worker holds an unacked message
    (a late-acked call running, a prefetched one, a retry waiting out its countdown):

    * tearing down the lost connection makes kombu hand the unacked messages back to Redis
      after the transport was detached, which raises ``AttributeError``;
    * after the reconnect, the ack of a call that ran across the restart goes to the old,
      closed channel and raises the same error from the event loop.

    Celery treats both as unrecoverable and shuts the worker down, so every Redis restart
    during work would stop every busy worker. Here both are logged and the worker goes on.
    Nothing is lost by that: a message that could not be acked or handed back stays in Redis's
    unacked set and returns after the visibility timeout, where the store turns the duplicate
    away, and a call still ``queued`` in the store is sent again by the republisher.
    """

    def on_connection_error_after_connected(self, exc: BaseException) -> None:
        try:
            super().on_connection_error_after_connected(exc)
        except Exception as err:  # noqa: BLE001 - any clean-up error: reconnect regardless
            self.connection = None
            log.warning("closing the lost broker connection failed (%r); reconnecting anyway",
                        err, extra={"action": "broker_cleanup_failed"})

    def call_soon_ack(self, p: Any, *args: Any, **kwargs: Any) -> Any:
        def ack_or_log(*a: Any, **kw: Any) -> Any:
            try:
                return p(*a, **kw)
            except Exception as err:  # noqa: BLE001 - a lost ack must not stop the worker
                log.warning("message could not be acked or rejected (%r); it returns after the "
                            "visibility timeout", err, extra={"action": "ack_failed"})
                return None

        return super().call_soon_ack(ack_or_log, *args, **kwargs)


def kill_child(pid: int, wait: float = 2.0) -> bool:
    """SIGKILL this process's child ``pid`` and wait until it has stopped running.

    Only a direct child is killed (a PID that was reaped and reused is left alone). Returns
    True when the process is gone or a zombie. Without ``/proc`` it does not wait.
    """
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.exists():
        fields = _proc_stat(stat)
        if fields is None or int(fields[1]) != os.getpid():
            return True
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    log.info("timed-out child killed", extra={"action": "child_killed", "pid": pid})
    if not stat.parent.parent.exists():
        return True
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        fields = _proc_stat(stat)
        if fields is None or fields[0] in ("Z", "X", "x"):
            return True
        time.sleep(0.002)
    return False


def _proc_stat(stat: Path) -> list[str] | None:
    """(state, ppid) of a process from ``/proc/<pid>/stat``, or None when it is gone."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ")".
    return text.rsplit(")", 1)[1].split()[:2]


def register_tasks(app: Celery) -> None:
    """Register the task kinds (and the sweep task) on ``app``.

    What each kind declares to Celery follows its effect classes (``retry.celery_retry_options``):

    * retrying (``read``, ``idempotent_write``): acknowledged late, requeued when its child is
      lost or killed by its hard time limit (the store counts those attempts and bounds
      them; a requeued message whose call has moved on changes nothing), ``autoretry_for=
      (TransientToolError,)`` with the configured backoff, cap, jitter and ``max_retries``.
      The body itself catches the tool's ``TransientToolError`` first, because the store must
      count the attempt and say ``queued`` before the retry message exists, and because each
      call's countdown and ``max_retries`` come from its policy snapshot, not the class: it
      retries through ``Task.retry`` with those values (``execution.report``). Celery's
      autoretry wrapper is the declared default and a backstop; the body never lets a
      ``TransientToolError`` reach it.
    * single-attempt (``non_idempotent_write``, ``unclassified``): acknowledged early, no
      retries at all (``max_retries=0``, nothing to autoretry).

    Both list ``CallFailure`` in ``throws``: a call that ended ``failed`` or
    ``outcome_unknown`` is an expected task failure, logged by Celery as one INFO line
    without a traceback (dex-tasks did not crash; the tool's error is in the store).
    The sweep task sends no task events (``send_events=False``), so the sweeps beat runs every
    few seconds do not crowd Flower's and ``celery events``' task lists.
    """
    settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]

    def retry_options(retrying: bool) -> dict[str, Any]:
        return celery_retry_options(
            retrying, base=settings.retry_backoff_base_seconds,
            cap=settings.retry_backoff_max_seconds, max_attempts=settings.default_max_attempts)

    # shared=False: the tasks belong to this app only, not to every Celery app the process
    # creates (Celery's default), which would register them twice.
    @app.task(name=RUN_RETRYING, bind=True, shared=False, acks_late=True,
              reject_on_worker_lost=True, acks_on_timeout=False, acks_on_failure=True,
              ignore_result=True,
              Request=DexRequest, throws=(CallFailure,), **retry_options(True))
    def call_tool(self: Task, key: str) -> None:
        run_retrying(self, key)

    @app.task(name=RUN_SINGLE_ATTEMPT, bind=True, shared=False, acks_late=False,
              ignore_result=True, Request=DexRequest, throws=(CallFailure,),
              **retry_options(False))
    def call_single_attempt_tool(self: Task, key: str) -> None:
        run_single_attempt(self, key)

    @app.task(name=SWEEP, bind=True, shared=False, acks_late=False, ignore_result=True,
              send_events=False)
    def sweep(self: Task, job: str) -> Any:
        return run_job(runtime(self.app), job)


def worker_app(settings: DexSettings, tools: Iterable[str] = (), *, pool: str = "prefork",
               concurrency: int = 1) -> Celery:
    """The app a ``dex-tasks worker`` runs: the shared configuration, the task kinds and the
    sweep task registered, the queues of ``tools`` consumed, and the signal handlers of
    ``hooks.py`` connected (announcing ``tools`` as served by this worker)."""
    app = create_app(settings)
    served = sorted(tools)
    consume_queues(app, served)
    register_tasks(app)
    hooks.install(app, served, pool=pool, concurrency=concurrency)
    return app
