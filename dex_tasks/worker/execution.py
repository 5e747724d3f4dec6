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

Each body records its outcome in the store first and then tells Celery
(``task_states.report``), so that Celery's own state for the message (what Flower and
``celery events`` show) agrees with the call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from billiard.exceptions import SoftTimeLimitExceeded, WorkerLostError
from celery import Celery, Task
from sqlalchemy.exc import DataError

from dex_tasks.broker import notify, webhooks
from dex_tasks.broker.celery_app import publish
from dex_tasks.broker.redis_clients import connector, redis_client
from dex_tasks.errors import OutcomeUnknownError, TransientToolError
from dex_tasks.limits import RESULT_DEPTH_MAX, storable_text
from dex_tasks.policy import EffectClass
from dex_tasks.registry import InvalidArguments, ToolContext, get_local_tool, strings_problem
from dex_tasks.settings import DexSettings
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store import INHERITED, Move, NetworkBounds, Store
from dex_tasks.store.models import ToolCallRow
from dex_tasks.worker import claims, retry
from dex_tasks.worker.task_states import Outcome, failure, ignored, report

log = logging.getLogger("dex_tasks.worker.execution")


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
        notify.install(self.store, self.settings.redis_url, connector(self.settings))
        # Approval events it writes (the deadline sweeps) are sent as webhooks after commit.
        webhooks.install(self.store, self.settings, lambda: self.app)


_runtime: Runtime | None = None
# The threads pool (and beat's sweep threads) may ask for the runtime from many threads at once.
_runtime_lock = threading.Lock()


def runtime(app: Celery) -> Runtime:
    """This process's runtime, created on first use."""
    global _runtime
    current = _runtime
    if current is not None and current.app is app:
        return current
    with _runtime_lock:
        if _runtime is None or _runtime.app is not app:
            settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
            _runtime = Runtime(
                settings=settings,
                store=Store(settings.database_url,
                            retry_seconds=settings.store_retry_seconds,
                            network=NetworkBounds.from_settings(settings)),
                redis=redis_client(settings, socket_timeout=10),
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


def current_owner(hostname: str | None) -> str:
    """The owner id of the attempt this thread runs.

    ``<node>:<pid>`` in a process that runs one call at a time (a prefork child), and
    ``<node>:<pid>:<thread id>`` in a pool thread: the threads of one process must never share
    an owner id, or a thread abandoned at its time limit could still finish the attempt that
    another thread of the same worker runs now.
    """
    owner = owner_id(hostname, os.getpid())
    if threading.current_thread() is threading.main_thread():
        return owner
    return f"{owner}:{threading.get_native_id()}"


# -- ending calls -------------------------------------------------------------------------------


def _dump_result(value: Any) -> str:
    # Too deep first (checked without recursing): the checks below, the encoder and every
    # reader recurse, and a RecursionError here once left the call running with no ending.
    if _depth_over(value, RESULT_DEPTH_MAX):
        raise ValueError(f"its result is nested deeper than {RESULT_DEPTH_MAX} levels, which "
                         "the store does not hold")
    # A NUL or a lone surrogate in a string: PostgreSQL's jsonb cannot hold it (see sqljson).
    problem = strings_problem(value, "its result")
    if problem:
        raise ValueError(problem)
    # allow_nan=False: NaN would be stored as JSON no other reader accepts (the API says null).
    return json.dumps(value, default=_unserialisable, allow_nan=False)


def _depth_over(value: Any, limit: int) -> bool:
    """True if lists, tuples and dicts nest deeper than ``limit`` in ``value`` (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list | tuple):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in item)
    return False


def _unserialisable(value: Any) -> Any:
    raise TypeError(f"tool returned a value of type {type(value).__name__}, not JSON")


def did_not_run(store: Store, call: ToolCallRow, why: str) -> bool:
    """End a queued call whose next attempt cannot start (expired, invalid, no tool here).

    Only a call that no attempt ever reached gets the "did not run" error. A retrying call
    queued again after a transient error or a lost worker did reach the tool, so it ends as
    if its attempts ran out: a read ``failed``, a write ``outcome_unknown``. The ``attempts``
    guard keeps a claim that lands between our read and this write from being mislabelled.
    """
    move = did_not_run_move(call, why)
    return store.transition(move.key, move.to, allowed={CallStatus.QUEUED}, match=move.match,
                            values=move.values, detail=move.detail)


def did_not_run_move(call: ToolCallRow, why: str) -> Move:
    """How :func:`did_not_run` ends ``call`` (for the sweeps' set-based transitions)."""
    if call.attempts == 0:
        error = f"{TOOL_DID_NOT_RUN}: {why}"
        to, reason = CallStatus.FAILED, "did_not_run"
    else:
        decision = retry.after_worker_lost(
            EffectClass(call.effect), call.attempts, call.attempts,
            f"{why}, after {call.attempts} attempt(s) had reached the tool", key=call.key,
        )
        assert decision.status is not None
        to, error, reason = decision.status, decision.error or why, "next_attempt_not_started"
    return Move(call.key, to, match={"attempts": call.attempts}, values={"error": error},
                detail={"reason": reason, "why": why})


def _end_unstarted(rt: Runtime, call: ToolCallRow, why: str) -> Outcome:
    """:func:`did_not_run` from a delivery, as the outcome Celery is told of."""
    move = did_not_run_move(call, why)
    if rt.store.transition(move.key, move.to, allowed={CallStatus.QUEUED}, match=move.match,
                           values=move.values, detail=move.detail):
        return Outcome(move.to, move.values["error"])
    return Outcome(None, why=_RACED)


def handle_lost_attempt(
    rt: Runtime, key: str, owner: str | None, reason: str, *, republish: bool
) -> CallStatus | None:
    """A running attempt is gone (child killed, hard time limit, a thread abandoned at its
    limit).

    Only acts while the call is still ``running`` under that owner: the child may have
    finished the work and recorded it just before dying, and a later attempt may own the call
    by now. ``republish`` sends a new message for a retry (for a lost child or a hard time
    limit on the retrying path, Celery requeues the message itself). Returns the status it
    moved the call to. (The reaper does the same for many calls at once, set-based, with
    :func:`lost_attempt_move`.)
    """
    call = rt.store.get_call(key)
    if call is None or call.status != CallStatus.RUNNING.value:
        return None
    if owner is not None and call.worker != owner:
        return None
    move = lost_attempt_move(call, reason, time.time())
    if not rt.store.transition(key, move.to, allowed={CallStatus.RUNNING}, match=move.match,
                               values=move.values, detail=move.detail):
        return None
    after_lost_attempt(rt, call, move, republish=republish)
    return move.to


def lost_attempt_move(call: ToolCallRow, reason: str, now: float) -> Move:
    """Where a call goes when its running attempt is lost: back to ``queued`` while attempts
    are left on the retrying path, else the ending its effect class gives (``retry.py``).
    Guarded on the attempt's owner and number, so a later attempt is never touched."""
    decision = retry.after_worker_lost(EffectClass(call.effect), call.attempts,
                                       call.max_attempts, reason, key=call.key)
    guard = {"worker": call.worker, "attempts": call.attempts}
    detail = {"reason": "attempt_lost", "attempt": call.attempts, "why": reason}
    if decision.retry:
        return Move(call.key, CallStatus.QUEUED, match=guard, detail=detail,
                    values={"worker": None, "lease_expires_at": None, "published_at": now})
    assert decision.status is not None
    return Move(call.key, decision.status, match=guard, values={"error": decision.error},
                detail=detail)


def after_lost_attempt(rt: Runtime, call: ToolCallRow, move: Move, *, republish: bool) -> None:
    """Log a lost attempt's move, and send the retry's message when one is needed."""
    if move.to is not CallStatus.QUEUED:
        log.info("attempt lost, call ended", extra={"action": "attempt_lost", "key": call.key,
                                                     "status": move.to.value})
        return
    if republish:
        try:
            publish(rt.app, call)
        except Exception:  # noqa: BLE001 - the republisher sweep picks it up
            _message_lost(rt, call.key, "republish_failed")
    log.info("attempt lost, retrying", extra={"action": "attempt_lost", "key": call.key})


def _message_lost(rt: Runtime, key: str, action: str) -> None:
    """A queued call's message is known lost (its publish failed, or the delivery could not
    claim it): mark it never published, which the republisher sends again on its next turn
    once Redis answers, instead of a whole ``republish_after_seconds`` later."""
    log.warning("call's message lost; the republisher sends it again", extra={
        "action": action, "key": key})
    try:
        rt.store.mark_unpublished(key)
    except Exception:  # then the republisher's window applies
        log.warning("could not mark the call unpublished", exc_info=True,
                    extra={"action": "mark_unpublished_failed", "key": key})


def _exhausted_before_claim(rt: Runtime, call: ToolCallRow, why: str) -> Outcome:
    """A queued retrying call delivered again after every attempt was used (by worker loss)."""
    decision = retry.after_worker_lost(
        EffectClass(call.effect), call.attempts, call.max_attempts, why, key=call.key)
    assert decision.status is not None
    if rt.store.transition(
        call.key, decision.status, allowed={CallStatus.QUEUED},
        match={"attempts": call.attempts},
        values={"error": decision.error}, detail={"reason": "attempts_exhausted"},
    ):
        return Outcome(decision.status, decision.error)
    return Outcome(None, why=_RACED)


# -- running a call -----------------------------------------------------------------------------


class _CannotRun(Exception):
    """The claimed call cannot run here: its claim is rolled back and the call is ended."""

    def __init__(self, why: str, call: ToolCallRow) -> None:
        super().__init__(why)
        self.why = why
        self.call = call


Claimed = tuple[ToolCallRow, Any, dict[str, Any]]


def _claim(rt: Runtime, key: str, owner: str) -> Claimed | Outcome | None:
    """The store's compare-and-set claim, queued -> running, and the checks before a tool runs.

    One statement on the common path, and no read before it: the claim's UPDATE returns the
    whole call. A call that expired in the queue or has no attempt left is not claimed at all
    (the claim's own guards, ``store.transitions.CLAIMABLE``): the claim returns nothing, and
    the call, read then, is ended "did not run" (or as if its attempts ran out) in a move of
    its own, guarded on its still being queued. The checks that need this worker (the tool is
    here, the arguments are valid for it) run on the row the claim returned; a call they
    refuse has its claim undone (rolled back, or on PostgreSQL moved back to ``queued`` with
    its attempt uncounted) and is ended likewise: the :class:`Outcome` of that is returned.
    Otherwise the call as claimed (``attempts`` is this attempt's number), the tool and the
    validated arguments; None for a call that was not queued (a duplicate delivery, a call
    that ended).
    """
    now = time.time()

    def vet(row: Any) -> tuple[Any, dict[str, Any]]:
        tool = get_local_tool(row.tool)
        if tool is None:
            raise _CannotRun(f"no worker that took it has the tool {row.tool!r}",
                             _before_claim(row))
        try:
            return tool, tool.validate(json.loads(row.arguments))
        except InvalidArguments as err:
            raise _CannotRun(str(err), _before_claim(row)) from None

    try:
        claimed = rt.store.claim(key, owner, rt.settings.lease_seconds, vet, now=now)
    except _CannotRun as refused:
        return _end_unstarted(rt, refused.call, refused.why)
    if claimed is None:
        return _not_claimed(rt, key, now)
    row, (tool, arguments) = claimed
    return cast(ToolCallRow, row), tool, arguments


def _not_claimed(rt: Runtime, key: str, now: float) -> Outcome | None:
    """A delivery whose claim matched nothing: the call is not queued (another delivery owns
    it, or it ended), or the claim's guards refused it. ``now`` is the claim's: a call read
    after it must be judged as the claim judged it."""
    call = rt.store.get_call(key)
    if call is not None and call.status == CallStatus.QUEUED.value:
        if call.expires_at is not None and now > call.expires_at:
            return _end_unstarted(rt, call, "it expired in the queue before a worker started it")
        if call.attempts >= call.max_attempts:
            return _exhausted_before_claim(
                rt, call, f"the worker was lost during each of the {call.attempts} attempts")
    # Another delivery owns it, or it is finished: a duplicate changes nothing.
    log.info("duplicate delivery ignored", extra={"action": "duplicate_delivery", "key": key})
    return None


def _before_claim(row: Any) -> ToolCallRow:
    """The call as it was before the claim that returned ``row`` (which is rolled back)."""
    return ToolCallRow.model_validate({
        **row._mapping, "status": CallStatus.QUEUED.value, "attempts": row.attempts - 1,
        "worker": None, "lease_expires_at": None, "prev_status": None})


def _finish(rt: Runtime, key: str, owner: str, to: CallStatus, **values: Any) -> bool:
    reason = values.pop("reason", None)
    try:
        return rt.store.transition(
            key, to, allowed={CallStatus.RUNNING}, match={"worker": owner},
            values=values, detail={"reason": reason} if reason else None,
        )
    except Exception as err:
        if not to.terminal or not _refused_for_its_data(err):
            raise
        # The ending was checked before this write, so this is a value the checks missed.
        # Left to raise, the call would stay running until its lease ran out and the reaper
        # ran it again or called the worker lost: it ends failed now, in a text that fits.
        log.warning("the store refused a call's ending; ending it failed", extra={
            "action": "ending_refused", "key": key, "status": to.value})
        error = (f"the tool ended ({to.value}) but the store refused to record that ending "
                 f"({_cause_name(err)})")
        return rt.store.transition(
            key, CallStatus.FAILED, allowed={CallStatus.RUNNING}, match={"worker": owner},
            values={"error": error}, detail={"reason": "ending_refused"})


def _refused_for_its_data(err: BaseException) -> bool:
    """True if the store refused a write for what it held (text it cannot encode, JSON it
    cannot parse, a value out of range), not because it was unreachable."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ValueError | RecursionError | DataError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cause_name(err: BaseException) -> str:
    """The innermost exception type behind ``err``: a name, never its text (which may hold
    exactly what the store refused)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return type(err).__name__


def _end(rt: Runtime, key: str, owner: str, to: CallStatus, error: str | None,
         reason: str) -> Outcome:
    """End the running attempt ``owner`` holds: the call becomes ``to`` with ``error``."""
    if _finish(rt, key, owner, to, error=error, reason=reason):
        return Outcome(to, error)
    return Outcome(None, why=_SUPERSEDED)


def _context(call: ToolCallRow, attempt: int) -> ToolContext:
    return ToolContext(
        idempotency_key=call.key,
        session_id=call.session_id,
        turn_id=call.turn_id,
        tool_call_id=call.tool_call_id,
        attempt=attempt,
    )


def _succeed(rt: Runtime, key: str, owner: str, value: Any) -> Outcome:
    try:
        dumped = _dump_result(value)
    except (TypeError, ValueError) as err:
        # The tool ran; its effect happened even though its result cannot be recorded.
        return _end(rt, key, owner, CallStatus.FAILED, f"the tool ran but {err}",
                    "result_not_json")
    if _finish(rt, key, owner, CallStatus.SUCCEEDED, result=dumped):
        return Outcome(CallStatus.SUCCEEDED)
    return Outcome(None, why=_SUPERSEDED)


_DUPLICATE = ("duplicate delivery: the call was not queued (another delivery owns it, it has "
              "ended, or it is not in the store)")
_RACED = "another delivery or a sweep changed the call first"
_SUPERSEDED = ("the tool returned, but its attempt had been ended or taken over meanwhile (its "
               "lease ran out); this attempt's outcome was not recorded")


# -- the task bodies ----------------------------------------------------------------------------


def run_retrying(task: Task, key: str) -> None:
    """Body of the retrying task kind."""
    rt = runtime(task.app)
    owner = current_owner(task.request.hostname)
    _claim_and_run(task, rt, key, owner, retrying=True)


def _claim_and_run(task: Task, rt: Runtime, key: str, owner: str, *, retrying: bool) -> None:
    """Claim the call in the store, run its attempt, and tell Celery how it ended."""
    claimed = _claim(rt, key, owner)
    if not isinstance(claimed, tuple):
        _report_unclaimed(task, key, claimed)
        return
    call, tool, arguments = claimed
    report(task, call, _attempt(rt, call, tool, arguments, owner, call.attempts,
                                retrying=retrying))


def _report_unclaimed(task: Task, key: str, outcome: Outcome | None) -> None:
    """Tell Celery about a delivery that ran no tool: it ended the call here (FAILURE), or it
    changed nothing (IGNORED)."""
    if outcome is None or outcome.status is None:
        raise ignored(task, key, _DUPLICATE if outcome is None else (outcome.why or _RACED))
    raise failure(outcome.status, outcome.error)


def _attempt(rt: Runtime, call: ToolCallRow, tool: Any, arguments: dict[str, Any],
             owner: str, attempt: int, *, retrying: bool) -> Outcome:
    """Run the tool once and record how that attempt ended.

    The two paths differ only in what a transient error and a soft time limit mean: the
    retrying path may try again (:func:`_interrupted_retrying`); the single-attempt path never
    does, so its transient error is a plain tool error and its time limit ends the call
    ``outcome_unknown`` (:func:`_interrupted_once`).
    """
    key = call.key
    try:
        value = tool(_context(call, attempt), **arguments)
    except OutcomeUnknownError as err:
        return _outcome_unknown(rt, key, owner, err)
    except (TransientToolError, SoftTimeLimitExceeded) as err:
        if retrying:
            return _interrupted_retrying(rt, call, owner, attempt, err)
        if isinstance(err, SoftTimeLimitExceeded):
            return _interrupted_once(rt, call, owner)
        return _tool_error(rt, key, owner, err)
    except SystemExit as err:
        # The process is exiting (the worker is stopping it, or the tool called sys.exit):
        # that is a lost worker, which the main process records (DexRequest). In a pool
        # thread nothing exits: see _exited_in_thread.
        return _exited_in_thread(rt, call, owner, err)
    except BaseException as err:  # noqa: BLE001 - see _tool_error
        return _tool_error(rt, key, owner, err)
    return _succeed(rt, key, owner, value)


def _interrupted_retrying(rt: Runtime, call: ToolCallRow, owner: str, attempt: int,
                          err: TransientToolError | SoftTimeLimitExceeded) -> Outcome:
    """A retrying call's transient error or soft time limit: retry while attempts are left."""
    key = call.key
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
        return _schedule_retry(rt, call, owner, attempt, decision.delay, message, err)
    if isinstance(err, SoftTimeLimitExceeded):
        # Stopped part-way on its last attempt: a read has no effect to be unsure about,
        # but an interrupted write may have taken effect, so it ends outcome_unknown.
        lost = retry.after_worker_lost(EffectClass(call.effect), attempt,
                                       call.max_attempts, message, key=key)
        assert lost.status is not None
        return _end(rt, key, owner, lost.status, lost.error, "attempts_exhausted")
    return _end(rt, key, owner, CallStatus.FAILED, decision.error, "attempts_exhausted")


def _interrupted_once(rt: Runtime, call: ToolCallRow, owner: str) -> Outcome:
    """A single-attempt call stopped by its time limit: whatever it had done stays done, and we
    cannot tell how much."""
    status = handle_lost_attempt(
        rt, call.key, owner, f"the tool was stopped by its time limit of {call.time_limit}s",
        republish=False)
    if status is None:
        return Outcome(None, why=_SUPERSEDED)
    ended = rt.store.get_call(call.key)
    return Outcome(status, ended.error if ended else None)


def _tool_error(rt: Runtime, key: str, owner: str, err: BaseException) -> Outcome:
    """Any other exception from the tool ends the call ``failed`` with its text, at once.

    That includes ``BaseException``s that are not ``Exception``s (``KeyboardInterrupt``, which
    in a worker's child can only come from the tool since the child ignores SIGINT, or a
    library's own): they are not transient, so the retrying path does not retry them either
    (the same rule as any non-transient error). Caught here, they never reach billiard, so the
    child stays and serves the next call. Celery's own exceptions raised by a tool (``Retry``,
    ``Ignore``, ``Reject``, ``WorkerLostError``...) are the tool's errors too: the task is
    ours, and only the body's own ``Task.retry`` / ``Ignore`` mean what Celery means by them.
    """
    return _end(rt, key, owner, CallStatus.FAILED, _error_text(err), "tool_error")


def _schedule_retry(
    rt: Runtime, call: ToolCallRow, owner: str, attempt: int, delay: float, message: str,
    cause: BaseException,
) -> Outcome:
    # published_at is set to when the message becomes due, so the republisher does not treat
    # a call waiting out its backoff as stranded. The store says queued before Celery sends
    # the retry (report), so the retry's delivery always finds the call ready to claim.
    due = time.time() + delay
    if not rt.store.transition(
        call.key, CallStatus.QUEUED, allowed={CallStatus.RUNNING},
        match={"worker": owner, "attempts": attempt},
        values={"worker": None, "lease_expires_at": None, "published_at": due},
        detail={"reason": "transient_error", "attempt": attempt, "retry_in": round(delay, 3),
                "error": message},
    ):
        return Outcome(None, why=_SUPERSEDED)
    # Celery's RETRY carries a plain copy of the error: the tool's own exception (a subclass
    # with another constructor) might not pickle on its way to the worker's main process.
    plain: BaseException = (TransientToolError(str(cause)) if isinstance(cause, TransientToolError)
                            else SoftTimeLimitExceeded(message))
    return Outcome(CallStatus.QUEUED, message, retry_in=delay, cause=plain)


def run_single_attempt(task: Task, key: str) -> None:
    """Body of the single-attempt task kind."""
    rt = runtime(task.app)
    owner = current_owner(task.request.hostname)
    # The Redis claim first: it turns a duplicate away without a store round trip. A worker
    # that dies between the two claims leaves the call queued, untouched by any tool, behind
    # a claim the republisher recognises as dead ("did not run").
    try:
        first = claims.try_claim(rt.redis, key, owner, rt.settings.claim_ttl_seconds,
                                 retry_seconds=rt.settings.claim_retry_seconds)
    except redis.RedisError as err:
        # The message is acknowledged and no tool ran: the republisher sends the call again
        # as soon as Redis answers, not a whole window later (issue 19, P2).
        _message_lost(rt, key, "claim_failed")
        raise ignored(task, key, f"the Redis claim failed ({type(err).__name__}: {err}); "
                                 "the call stays queued and is sent again") from err
    if not first:
        log.info("claim taken, duplicate ignored", extra={"action": "duplicate_delivery",
                                                          "key": key})
        raise ignored(task, key, _DUPLICATE)
    _claim_and_run(task, rt, key, owner, retrying=False)


def _exited_in_thread(rt: Runtime, call: ToolCallRow, owner: str, err: SystemExit) -> Outcome:
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
    reason = f"the tool exited its worker thread ({_error_text(err)}), a lost worker"
    status = handle_lost_attempt(rt, call.key, owner, reason, republish=False)
    if status is None:
        return Outcome(None, why=_SUPERSEDED)
    if status is CallStatus.QUEUED:
        return Outcome(status, reason, cause=WorkerLostError(reason))
    ended = rt.store.get_call(call.key)
    return Outcome(status, ended.error if ended else reason)


def _outcome_unknown(rt: Runtime, key: str, owner: str, err: OutcomeUnknownError) -> Outcome:
    # The tool itself says it cannot tell: no retry, whatever the path and attempts left.
    reason = f"the tool could not tell whether its effect happened ({_error_text(err)})"
    return _end(rt, key, owner, CallStatus.OUTCOME_UNKNOWN, retry.outcome_unknown_text(reason, key),
                "tool_outcome_unknown")


def _error_text(err: BaseException) -> str:
    """``Type: message`` of a tool's error, as a text the store can hold on every engine.

    A message with a NUL or a lone surrogate gets U+FFFD in their place, and an exception
    whose ``__str__`` raises is named with why: its call must still end, and say so.
    """
    name = type(err).__name__
    try:
        text = str(err)
    except Exception as inner:  # noqa: BLE001 - the tool's own __str__, whatever it raises
        return f"{name} (its message could not be read: {type(inner).__name__})"
    return storable_text(f"{name}: {text}" if text else name)
