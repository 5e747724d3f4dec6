"""The bodies of the two task kinds, and the decisions on lost attempts.

Retrying path (``read``, ``idempotent_write``): acknowledged late; a lost child's message is
requeued by Celery (``reject_on_worker_lost``). Celery puts no cap on that, so every claim
counts an attempt in the store and a delivery past ``max_attempts`` ends the call instead.

Single-attempt path (``non_idempotent_write``, ``unclassified``): acknowledged early; a Redis
``SET NX`` claim turns duplicate deliveries away cheaply, and the store's compare-and-set claim
decides. Once a call is ``running`` it is never run again: a lost child or a hard time limit
ends it ``outcome_unknown``.

A child that is killed runs none of its own hooks, so the worker's main process handles the
loss (``main_process.DexRequest``, calling :func:`handle_lost_attempt`). A whole worker that
dies runs nothing at all; its leases stop being renewed and the reaper in ``sweeps.py``
finishes the job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, Task

from dex_tasks import claims, notify, retry
from dex_tasks.celery_app import publish
from dex_tasks.errors import OutcomeUnknownError, TransientToolError
from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass
from dex_tasks.registry import InvalidArguments, ToolContext, get_local_tool
from dex_tasks.settings import DexSettings
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store import INHERITED, Store

log = logging.getLogger("dex_tasks.execution")


@dataclass
class Runtime:
    """The per-process connections a worker uses. Created lazily, after the fork."""

    settings: DexSettings
    store: Store
    redis: redis.Redis
    app: Celery

    def __post_init__(self) -> None:
        # Every runtime ends calls (worker children, the main process, sweeps): announce each
        # one on Redis after its commit, which wakes its waiters and counts it for /metrics.
        notify.install(self.store, self.settings.redis_url)


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
    """Start over with connections of this process's own (in a forked child).

    The inherited runtime is kept referenced, not closed: closing its connections here would
    close the parent's (see ``store.INHERITED``).
    """
    global _runtime
    if _runtime is not None:
        INHERITED.append(_runtime)
    _runtime = None


def owner_id(hostname: str | None, pid: int | None) -> str:
    """How a running call names the process that runs it: ``<worker node>:<child pid>``."""
    return f"{hostname}:{pid}"


# -- ending calls -------------------------------------------------------------------------------


def _dump_result(value: Any) -> str:
    # allow_nan=False: NaN would be stored as JSON no other reader accepts (the API says null).
    return json.dumps(value, default=_unserialisable, allow_nan=False)


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"tool returned a value of type {type(value).__name__}, not JSON")


def did_not_run(store: Store, call: ToolCallRow, why: str) -> bool:
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
        match={"attempts": call.attempts},
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
    guard = {"worker": call.worker, "attempts": call.attempts}
    if decision.retry:
        now = time.time()
        if not rt.store.transition(
            key,
            CallStatus.QUEUED,
            allowed={CallStatus.RUNNING},
            match=guard,
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
        match=guard,
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
        match={"attempts": call.attempts},
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
        did_not_run(rt.store, call, "it expired in the queue before a worker started it")
        return None
    tool = get_local_tool(call.tool)
    if tool is None:
        did_not_run(rt.store, call, f"no worker that took it has the tool {call.tool!r}")
        return None
    try:
        arguments = tool.validate(json.loads(call.arguments))
    except InvalidArguments as err:
        did_not_run(rt.store, call, str(err))
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
        match={"attempts": call.attempts},
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
        key, to, allowed={CallStatus.RUNNING}, match={"worker": owner},
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
    except OutcomeUnknownError as err:
        _outcome_unknown(rt, key, owner, err)
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
        match={"worker": owner},
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
    except OutcomeUnknownError as err:
        _outcome_unknown(rt, key, owner, err)
    except SoftTimeLimitExceeded:
        # Interrupted part-way: whatever it had done stays done, and we cannot tell how much.
        handle_lost_attempt(rt, key, owner,
                            f"the tool was stopped by its time limit of {call.time_limit}s",
                            republish=False)
    except Exception as err:  # noqa: BLE001 - a tool error ends the call with its message
        _finish(rt, key, owner, CallStatus.FAILED, error=_error_text(err), reason="tool_error")
    else:
        _succeed(rt, key, owner, value)


def _outcome_unknown(rt: Runtime, key: str, owner: str, err: OutcomeUnknownError) -> None:
    # The tool itself says it cannot tell: no retry, whatever the path and attempts left.
    reason = f"the tool could not tell whether its effect happened ({_error_text(err)})"
    _finish(rt, key, owner, CallStatus.OUTCOME_UNKNOWN, error=retry.outcome_unknown_text(reason),
            reason="tool_outcome_unknown")


def _error_text(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
