"""Running one attempt of a claimed call: the tool is called once, and how that attempt ended
(a result, the tool's error, a transient error or a soft time limit, the tool saying it cannot
tell, an exit) is recorded through ``endings.py``."""

from __future__ import annotations

import threading
import time
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded, WorkerLostError

from dex_tasks.errors import OutcomeUnknownError, TransientToolError
from dex_tasks.policy import EffectClass
from dex_tasks.registry import ToolContext
from dex_tasks.states import CallStatus
from dex_tasks.store.models import ToolCallRow
from dex_tasks.worker import retry
from dex_tasks.worker.endings import (
    SUPERSEDED,
    Attempt,
    end,
    error_text,
    handle_lost_attempt,
    release_run,
    succeed,
)
from dex_tasks.worker.leased import lost_run
from dex_tasks.worker.runtime import Runtime
from dex_tasks.worker.spans import run_tool
from dex_tasks.worker.task_states import Outcome


def tool_context(call: ToolCallRow, attempt: int) -> ToolContext:
    return ToolContext(
        idempotency_key=call.key,
        session_id=call.session_id,
        turn_id=call.turn_id,
        tool_call_id=call.tool_call_id,
        attempt=attempt,
    )



def run_attempt(rt: Runtime, call: ToolCallRow, tool: Any, arguments: dict[str, Any],
                attempt: Attempt, *, retrying: bool) -> Outcome:
    """Run the tool once and record how that attempt ended.

    The two paths differ only in what a transient error and a soft time limit mean: the
    retrying path may try again (:func:`_interrupted_retrying`); the single-attempt path never
    does, so its transient error is a plain tool error and its time limit ends the call
    ``outcome_unknown`` (:func:`_interrupted_once`).
    """
    rt.ends.started()
    try:
        return _run(rt, call, tool, arguments, attempt, retrying=retrying)
    finally:
        rt.ends.left()


def _run(rt: Runtime, call: ToolCallRow, tool: Any, arguments: dict[str, Any],
         attempt: Attempt, *, retrying: bool) -> Outcome:
    key = call.key
    try:
        value = run_tool(call, attempt.number, tool, tool_context(call, attempt.number),
                         arguments)
    except OutcomeUnknownError as err:
        return _outcome_unknown(rt, key, attempt, err)
    except (TransientToolError, SoftTimeLimitExceeded) as err:
        if retrying:
            return _interrupted_retrying(rt, call, attempt, err)
        if isinstance(err, SoftTimeLimitExceeded):
            return _interrupted_once(rt, call, attempt.owner)
        return _tool_error(rt, key, attempt, err)
    except SystemExit as err:
        # The process is exiting (the worker is stopping it, or the tool called sys.exit):
        # that is a lost worker, which the main process records (DexRequest). In a pool
        # thread nothing exits: see _exited_in_thread.
        return _exited_in_thread(rt, call, attempt, err)
    except BaseException as err:  # noqa: BLE001 - see _tool_error
        return _tool_error(rt, key, attempt, err)
    return succeed(rt, key, attempt, value)


def _interrupted_retrying(rt: Runtime, call: ToolCallRow, attempt: Attempt,
                          err: TransientToolError | SoftTimeLimitExceeded) -> Outcome:
    """A retrying call's transient error or soft time limit: retry while attempts are left."""
    key = call.key
    message = error_text(err) if isinstance(err, TransientToolError) else (
        f"the tool hit its soft time limit of {call.time_limit}s"
    )
    decision = retry.after_transient_error(
        EffectClass(call.effect), attempt.number, call.max_attempts, message,
        base=rt.settings.retry_backoff_base_seconds,
        cap=rt.settings.retry_backoff_max_seconds,
        retry_after=getattr(err, "retry_after", None),
    )
    if decision.retry:
        return _schedule_retry(rt, call, attempt, decision.delay, message, err)
    if isinstance(err, SoftTimeLimitExceeded):
        # Stopped part-way on its last attempt: a read has no effect to be unsure about,
        # but an interrupted write may have taken effect, so it ends outcome_unknown.
        lost = retry.after_worker_lost(EffectClass(call.effect), attempt.number,
                                       call.max_attempts, message, key=key)
        assert lost.status is not None
        return end(rt, key, attempt, lost.status, lost.error, "attempts_exhausted")
    return end(rt, key, attempt, CallStatus.FAILED, decision.error, "attempts_exhausted")


def _interrupted_once(rt: Runtime, call: ToolCallRow, owner: str) -> Outcome:
    """A single-attempt call stopped by its time limit: whatever it had done stays done, and we
    cannot tell how much."""
    status = handle_lost_attempt(
        rt, call.key, owner, f"the tool was stopped by its time limit of {call.time_limit}s",
        republish=False)
    if status is None:
        return Outcome(None, why=SUPERSEDED)
    ended = rt.store.get_call(call.key)
    return Outcome(status, ended.error if ended else None)


def _tool_error(rt: Runtime, key: str, attempt: Attempt, err: BaseException) -> Outcome:
    """Any other exception from the tool ends the call ``failed`` with its text, at once.

    That includes ``BaseException``s that are not ``Exception``s (``KeyboardInterrupt``, which
    in a worker's child can only come from the tool since the child ignores SIGINT, or a
    library's own): they are not transient, so the retrying path does not retry them either
    (the same rule as any non-transient error). Caught here, they never reach billiard, so the
    child stays and serves the next call. Celery's own exceptions raised by a tool (``Retry``,
    ``Ignore``, ``Reject``, ``WorkerLostError``...) are the tool's errors too: the task is
    ours, and only the body's own ``Task.retry`` / ``Ignore`` mean what Celery means by them.
    """
    return end(rt, key, attempt, CallStatus.FAILED, error_text(err), "tool_error")


def _schedule_retry(
    rt: Runtime, call: ToolCallRow, attempt: Attempt, delay: float, message: str,
    cause: BaseException,
) -> Outcome:
    # published_at is set to when the message becomes due, so the republisher does not treat
    # a call waiting out its backoff as stranded. The store says queued before Celery sends
    # the retry (report), so the retry's delivery always finds the call ready to claim.
    due = time.time() + delay
    detail = {"reason": "transient_error", "attempt": attempt.number,
              "retry_in": round(delay, 3), "error": message}
    if attempt.stored is not None:
        # A leased attempt: the store counts it now (its start and its retry, no status
        # change), and its run in Redis is dropped so the retry can start.
        recorded = rt.store.record_attempt(
            call.key, stored=attempt.stored, attempt=attempt.number, owner=attempt.owner,
            started=attempt.started, detail=detail, published_at=due)
        release_run(rt, call.key, attempt.owner)
    else:
        recorded = rt.store.transition(
            call.key, CallStatus.QUEUED, allowed={CallStatus.RUNNING},
            match={"worker": attempt.owner, "attempts": attempt.number},
            values={"worker": None, "lease_expires_at": None, "published_at": due},
            detail=detail)
    if not recorded:
        return Outcome(None, why=SUPERSEDED)
    # Celery's RETRY carries a plain copy of the error: the tool's own exception (a subclass
    # with another constructor) might not pickle on its way to the worker's main process.
    plain: BaseException = (TransientToolError(str(cause)) if isinstance(cause, TransientToolError)
                            else SoftTimeLimitExceeded(message))
    return Outcome(CallStatus.QUEUED, message, retry_in=delay, cause=plain)



def _exited_in_thread(rt: Runtime, call: ToolCallRow, attempt: Attempt,
                      err: SystemExit) -> Outcome:
    """A tool called ``sys.exit()``: a lost worker, recorded at once.

    In a prefork child the exit goes on, the child dies and the main process records the loss
    (``DexRequest``). In a pool thread (``-P threads``) it would only end the thread's task:
    Celery's threads pool hands the error to the request's success callback, which drops it,
    so the call stayed ``running`` with its lease renewed for ever and its slot taken. So the
    thread records the loss itself, as the main process would: a single-attempt call ends
    ``outcome_unknown``, a retrying call is queued again while attempts are left (its message
    sent through ``Task.retry``), and the request ends normally, freeing its slot.
    """
    if threading.current_thread() is threading.main_thread():
        raise err
    reason = f"the tool exited its worker thread ({error_text(err)}), a lost worker"
    if attempt.leased:
        # The call as the store has it (queued, its stored attempts), not as it runs.
        stored = call.model_copy(update={"status": CallStatus.QUEUED.value,
                                         "attempts": attempt.stored, "worker": None})
        status = lost_run(rt, stored, attempt.owner, reason, republish=False)
    else:
        status = handle_lost_attempt(rt, call.key, attempt.owner, reason, republish=False)
    if status is None:
        return Outcome(None, why=SUPERSEDED)
    if status is CallStatus.QUEUED:
        return Outcome(status, reason, cause=WorkerLostError(reason))
    ended = rt.store.get_call(call.key)
    return Outcome(status, ended.error if ended else reason)


def _outcome_unknown(rt: Runtime, key: str, attempt: Attempt,
                     err: OutcomeUnknownError) -> Outcome:
    # The tool itself says it cannot tell: no retry, whatever the path and attempts left.
    reason = f"the tool could not tell whether its effect happened ({error_text(err)})"
    return end(rt, key, attempt, CallStatus.OUTCOME_UNKNOWN,
               retry.outcome_unknown_text(reason, key), "tool_outcome_unknown")

