"""The two task kinds, and what the worker's main process does when a child is lost.

Retrying path (``read``, ``idempotent_write``): acknowledged late; a lost child's message is
requeued by Celery (``reject_on_worker_lost``). Celery puts no cap on that, so every claim
counts an attempt in the store and a delivery past ``max_attempts`` ends the call instead.

Single-attempt path (``non_idempotent_write``, ``unclassified``): acknowledged early; a Redis
``SET NX`` claim turns duplicate deliveries away cheaply, and the store's compare-and-set claim
decides. Once a call is ``running`` it is never run again: a lost child or a hard time limit
ends it ``outcome_unknown``.

A child that is killed runs none of its own hooks, so the worker's main process handles the
loss in :class:`DexRequest`. A whole worker that dies runs nothing at all; its leases stop being
renewed and the reaper in ``sweeps.py`` finishes the job.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from celery import Celery, Task
from celery.worker.consumer import Consumer
from celery.worker.request import Request

from dex_tasks import claims, retry
from dex_tasks.celery_app import RUN_RETRYING, RUN_SINGLE_ATTEMPT, SWEEP, publish
from dex_tasks.errors import TransientToolError
from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass
from dex_tasks.registry import InvalidArguments, ToolContext, get_local_tool
from dex_tasks.settings import DexSettings
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store import CALLS, Store

log = logging.getLogger("dex_tasks.execution")


@dataclass
class Runtime:
    """The per-process connections a worker uses. Created lazily, after the fork."""

    settings: DexSettings
    store: Store
    redis: redis.Redis
    app: Celery


_runtime: Runtime | None = None


def runtime(app: Celery) -> Runtime:
    """This process's runtime, created on first use."""
    global _runtime
    if _runtime is None or _runtime.app is not app:
        settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
        _runtime = Runtime(
            settings=settings,
            store=Store(settings.database_url),
            redis=redis.Redis.from_url(settings.redis_url, socket_timeout=10),
            app=app,
        )
    return _runtime


def reset_runtime() -> None:
    """Forget this process's connections (a forked child must not share its parent's)."""
    global _runtime
    _runtime = None


def owner_id(hostname: str | None, pid: int | None) -> str:
    """How a running call names the process that runs it: ``<worker node>:<child pid>``."""
    return f"{hostname}:{pid}"


# -- ending calls -------------------------------------------------------------------------------


def _dump_result(value: Any) -> str:
    return json.dumps(value, default=_unserialisable)


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"tool returned a value of type {type(value).__name__}, not JSON")


def _did_not_run(store: Store, call: ToolCallRow, why: str) -> bool:
    """End a queued call whose next attempt cannot start (expired, invalid, no tool here).

    Only a call that no attempt ever reached gets the "did not run" error. A retrying call
    queued again after a transient error or a lost worker did reach the tool, so it ends as
    if its attempts ran out: a read ``failed``, a write ``outcome_unknown``. The ``attempts``
    guard keeps a claim that lands between our read and this write from being mislabelled.
    """
    if call.attempts == 0:
        error = f"{TOOL_DID_NOT_RUN}: {why}"
        to, reason = CallStatus.FAILED, "did_not_run"
    else:
        decision = retry.after_worker_lost(
            EffectClass(call.effect), call.attempts, call.attempts,
            f"{why}, after {call.attempts} attempt(s) had reached the tool",
        )
        assert decision.status is not None
        to, error, reason = decision.status, decision.error or why, "next_attempt_not_started"
    return store.transition(
        call.key,
        to,
        allowed={CallStatus.QUEUED},
        where=[CALLS.c.attempts == call.attempts],
        values={"error": error},
        detail={"reason": reason, "why": why},
    )


def handle_lost_attempt(
    rt: Runtime, key: str, owner: str | None, reason: str, *, republish: bool
) -> CallStatus | None:
    """A running attempt is gone (child killed, hard time limit, lease expired).

    Only acts while the call is still ``running`` under that owner: the child may have
    finished the work and recorded it just before dying, and a later attempt may own the call
    by now. ``republish`` sends a new message for a retry (Celery requeues the message itself
    only for a lost child on the retrying path). Returns the status it moved the call to.
    """
    call = rt.store.get_call(key)
    if call is None or call.status != CallStatus.RUNNING.value:
        return None
    if owner is not None and call.worker != owner:
        return None
    effect = EffectClass(call.effect)
    decision = retry.after_worker_lost(effect, call.attempts, call.max_attempts, reason)
    guard = [CALLS.c.worker == call.worker, CALLS.c.attempts == call.attempts]
    if decision.retry:
        now = time.time()
        if not rt.store.transition(
            key,
            CallStatus.QUEUED,
            allowed={CallStatus.RUNNING},
            where=guard,
            values={"worker": None, "lease_expires_at": None, "published_at": now},
            detail={"reason": "attempt_lost", "attempt": call.attempts, "why": reason},
        ):
            return None
        if republish:
            try:
                publish(rt.app, call)
            except Exception:  # noqa: BLE001 - the republisher sweep picks it up
                log.warning("republish failed", extra={"action": "republish_failed", "key": key})
        log.info("attempt lost, retrying", extra={"action": "attempt_lost", "key": key})
        return CallStatus.QUEUED
    assert decision.status is not None
    if rt.store.transition(
        key,
        decision.status,
        allowed={CallStatus.RUNNING},
        where=guard,
        values={"error": decision.error},
        detail={"reason": "attempt_lost", "attempt": call.attempts, "why": reason},
    ):
        log.info("attempt lost, call ended", extra={"action": "attempt_lost", "key": key,
                                                     "status": decision.status.value})
        return decision.status
    return None


def _exhausted_before_claim(rt: Runtime, call: ToolCallRow) -> None:
    """A queued retrying call delivered again after every attempt was used (by worker loss)."""
    decision = retry.after_worker_lost(
        EffectClass(call.effect), call.attempts, call.max_attempts,
        f"the worker was lost during each of the {call.attempts} attempts",
    )
    assert decision.status is not None
    rt.store.transition(
        call.key, decision.status, allowed={CallStatus.QUEUED},
        where=[CALLS.c.attempts == call.attempts],
        values={"error": decision.error}, detail={"reason": "attempts_exhausted"},
    )


# -- running a call -----------------------------------------------------------------------------


def _prepare(rt: Runtime, key: str) -> tuple[ToolCallRow, Any, dict[str, Any]] | None:
    """Load a queued call and check it can run here; end it "did not run" if it cannot."""
    call = rt.store.get_call(key)
    if call is None:
        log.warning("message for an unknown call", extra={"action": "unknown_call", "key": key})
        return None
    if call.status != CallStatus.QUEUED.value:
        # Another delivery owns it, or it is finished: a duplicate changes nothing.
        log.info("duplicate delivery ignored",
                 extra={"action": "duplicate_delivery", "key": key, "status": call.status})
        return None
    if call.expires_at is not None and time.time() > call.expires_at:
        _did_not_run(rt.store, call, "it expired in the queue before a worker started it")
        return None
    tool = get_local_tool(call.tool)
    if tool is None:
        _did_not_run(rt.store, call, f"no worker that took it has the tool {call.tool!r}")
        return None
    try:
        arguments = tool.validate(json.loads(call.arguments))
    except InvalidArguments as err:
        _did_not_run(rt.store, call, str(err))
        return None
    return call, tool, arguments


def _claim(rt: Runtime, call: ToolCallRow, owner: str) -> int | None:
    """The store's compare-and-set claim: queued -> running. Returns the attempt number."""
    attempt = call.attempts + 1
    now = time.time()
    won = rt.store.transition(
        call.key,
        CallStatus.RUNNING,
        allowed={CallStatus.QUEUED},
        where=[CALLS.c.attempts == call.attempts],
        values={
            "attempts": attempt,
            "worker": owner,
            "lease_expires_at": now + rt.settings.lease_seconds,
        },
        detail={"attempt": attempt, "worker": owner},
        now=now,
    )
    return attempt if won else None


def _finish(rt: Runtime, key: str, owner: str, to: CallStatus, **values: Any) -> bool:
    reason = values.pop("reason", None)
    return rt.store.transition(
        key, to, allowed={CallStatus.RUNNING}, where=[CALLS.c.worker == owner],
        values=values, detail={"reason": reason} if reason else None,
    )


def _context(call: ToolCallRow, attempt: int) -> ToolContext:
    return ToolContext(
        idempotency_key=call.key,
        session_id=call.session_id,
        turn_id=call.turn_id,
        tool_call_id=call.tool_call_id,
        attempt=attempt,
    )


def _succeed(rt: Runtime, key: str, owner: str, value: Any) -> None:
    try:
        dumped = _dump_result(value)
    except (TypeError, ValueError) as err:
        # The tool ran; its effect happened even though its result cannot be recorded.
        _finish(rt, key, owner, CallStatus.FAILED, error=f"the tool ran but {err}",
                reason="result_not_json")
        return
    _finish(rt, key, owner, CallStatus.SUCCEEDED, result=dumped)


def run_retrying(task: Task, key: str) -> None:
    """Body of the retrying task kind."""
    rt = runtime(task.app)
    prepared = _prepare(rt, key)
    if prepared is None:
        return
    call, tool, arguments = prepared
    if call.attempts >= call.max_attempts:
        _exhausted_before_claim(rt, call)
        return
    owner = owner_id(task.request.hostname, os.getpid())
    attempt = _claim(rt, call, owner)
    if attempt is None:
        return
    try:
        value = tool(_context(call, attempt), **arguments)
    except (TransientToolError, SoftTimeLimitExceeded) as err:
        message = _error_text(err) if isinstance(err, TransientToolError) else (
            f"the tool hit its soft time limit of {call.time_limit}s"
        )
        decision = retry.after_transient_error(
            EffectClass(call.effect), attempt, call.max_attempts, message,
            base=rt.settings.retry_backoff_base_seconds,
            cap=rt.settings.retry_backoff_max_seconds,
            retry_after=getattr(err, "retry_after", None),
        )
        if decision.retry:
            _schedule_retry(rt, call, owner, attempt, decision.delay, message)
        elif isinstance(err, SoftTimeLimitExceeded):
            # Stopped part-way on its last attempt: a read has no effect to be unsure about,
            # but an interrupted write may have taken effect, so it ends outcome_unknown.
            lost = retry.after_worker_lost(EffectClass(call.effect), attempt,
                                           call.max_attempts, message)
            assert lost.status is not None
            _finish(rt, key, owner, lost.status, error=lost.error, reason="attempts_exhausted")
        else:
            _finish(rt, key, owner, CallStatus.FAILED, error=decision.error,
                    reason="attempts_exhausted")
    except Exception as err:  # noqa: BLE001 - any tool error ends the call with its message
        _finish(rt, key, owner, CallStatus.FAILED, error=_error_text(err), reason="tool_error")
    else:
        _succeed(rt, key, owner, value)


def _schedule_retry(
    rt: Runtime, call: ToolCallRow, owner: str, attempt: int, delay: float, message: str
) -> None:
    # published_at is set to when the message becomes due, so the republisher does not treat
    # a call waiting out its backoff as stranded.
    due = time.time() + delay
    if not rt.store.transition(
        call.key, CallStatus.QUEUED, allowed={CallStatus.RUNNING},
        where=[CALLS.c.worker == owner],
        values={"worker": None, "lease_expires_at": None, "published_at": due},
        detail={"reason": "transient_error", "attempt": attempt, "retry_in": round(delay, 3),
                "error": message},
    ):
        return
    try:
        publish(rt.app, call, countdown=delay)
    except Exception:  # noqa: BLE001 - left queued; the republisher sends it later
        log.warning("retry publish failed", extra={"action": "republish_failed", "key": call.key})


def run_single_attempt(task: Task, key: str) -> None:
    """Body of the single-attempt task kind."""
    rt = runtime(task.app)
    prepared = _prepare(rt, key)
    if prepared is None:
        return
    call, tool, arguments = prepared
    owner = owner_id(task.request.hostname, os.getpid())
    if not claims.try_claim(rt.redis, key, owner, rt.settings.claim_ttl_seconds):
        log.info("claim taken, duplicate ignored", extra={"action": "duplicate_delivery",
                                                          "key": key})
        return
    attempt = _claim(rt, call, owner)
    if attempt is None:
        return
    try:
        value = tool(_context(call, attempt), **arguments)
    except SoftTimeLimitExceeded:
        # Interrupted part-way: whatever it had done stays done, and we cannot tell how much.
        handle_lost_attempt(rt, key, owner,
                            f"the tool was stopped by its time limit of {call.time_limit}s",
                            republish=False)
    except Exception as err:  # noqa: BLE001 - a tool error ends the call with its message
        _finish(rt, key, owner, CallStatus.FAILED, error=_error_text(err), reason="tool_error")
    else:
        _succeed(rt, key, owner, value)


def _error_text(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# -- the worker's main process ------------------------------------------------------------------


class DexRequest(Request):  # type: ignore[misc]
    """Celery request that records lost attempts from the worker's main process.

    ``on_failure`` here runs in the parent, also when the child was SIGKILLed
    (``WorkerLostError``) or killed by the hard time limit (``TimeLimitExceeded``), which the
    child itself can never report.
    """

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, TimeLimitExceeded):
            self._kill_child()
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded, SystemExit)):
            self._record_lost(exc)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._kill_child()
            self._record_lost(TimeLimitExceeded(timeout))
        super().on_timeout(soft, timeout)

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

    def _record_lost(self, exc: BaseException) -> None:
        try:
            key = self.args[0]
            owner = owner_id(self.hostname, self.worker_pid) if self.worker_pid else None
            if owner is None:
                # We cannot tell which child ran it; the lease reaper will decide safely.
                return
            if isinstance(exc, TimeLimitExceeded):
                reason = f"the tool was killed by its hard time limit ({exc.args[0]}s)"
            else:
                reason = f"the worker process running the tool was lost ({exc})"
            # Celery requeues a lost child's message itself on the retrying path; a hard time
            # limit acks it, so that retry needs a new message.
            republish = isinstance(exc, TimeLimitExceeded)
            handle_lost_attempt(runtime(self.task.app), key, owner, reason, republish=republish)
        except Exception:
            log.exception("could not record a lost attempt", extra={"action": "lost_hook_error"})


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
    """Register the task kinds (and the sweep task) on ``app``."""

    @app.task(name=RUN_RETRYING, bind=True, acks_late=True, reject_on_worker_lost=True,
              ignore_result=True, Request=DexRequest)
    def call_tool(self: Task, key: str) -> None:
        run_retrying(self, key)

    @app.task(name=RUN_SINGLE_ATTEMPT, bind=True, acks_late=False, ignore_result=True,
              Request=DexRequest)
    def call_single_attempt_tool(self: Task, key: str) -> None:
        run_single_attempt(self, key)

    @app.task(name=SWEEP, bind=True, acks_late=False, ignore_result=True)
    def sweep(self: Task, job: str) -> Any:
        from dex_tasks.sweeps import run_job

        return run_job(runtime(self.app), job)
