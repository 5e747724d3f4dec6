"""How calls end from a worker: an attempt's outcome recorded, calls that cannot start ended
"did not run", and the decisions on lost attempts (``handle_lost_attempt`` for the main
process and the threads pool's watchdog, ``lost_attempt_move`` for the reaper).

Every ending is a guarded transition in the store: whoever ends a call second changes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError

from dex_tasks.broker.celery_app import publish
from dex_tasks.limits import RESULT_DEPTH_MAX, storable_text
from dex_tasks.policy import EffectClass
from dex_tasks.registry import strings_problem
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store import Move, Started, Store
from dex_tasks.store.models import ToolCallRow
from dex_tasks.worker import retry
from dex_tasks.worker.runtime import Runtime
from dex_tasks.worker.task_states import Outcome

log = logging.getLogger("dex_tasks.worker.execution")


# -- the attempt being ended -------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """The attempt a worker runs, and what guards its ending.

    ``stored`` None: the single-attempt path, whose claim stored ``running`` under ``owner``;
    its ending is guarded on that owner. Otherwise a retrying call whose attempt is a lease in
    Redis (``broker/runs.py``): the store still says ``queued`` with ``stored`` attempts, and
    the ending, guarded on that count, records the attempt's start (``started``, this
    worker's clock) with its end.
    """

    owner: str
    number: int
    stored: int | None = None
    started: float = 0.0

    @property
    def leased(self) -> bool:
        return self.stored is not None

    def guards(self) -> tuple[set[CallStatus], dict[str, Any], dict[str, Any], Started | None]:
        """(the statuses it may leave, the guards, the values it writes, its start)."""
        if self.stored is None:
            return {CallStatus.RUNNING}, {"worker": self.owner}, {}, None
        return ({CallStatus.QUEUED}, {"attempts": self.stored},
                {"attempts": self.number, "worker": self.owner},
                Started(self.started, {"attempt": self.number, "worker": self.owner}))


def release_run(rt: Runtime, key: str, owner: str) -> None:
    """Drop a leased attempt's run in Redis once the store has its outcome, keeping the call's
    attempt count (an ended call's count goes with the announcement of its end). Best effort:
    a run left behind lapses with its lease, and the reaper then finds its call moved on."""
    try:
        rt.runs.release(key, owner)
    except redis.RedisError as err:
        log.warning("a running call's lease was not released; it lapses", extra={
            "action": "run_release_failed", "key": key, "error": str(err)[:200]})


# -- ending calls -------------------------------------------------------------------------------


def dump_result(value: Any) -> str:
    # Too deep first (checked without recursing): the checks below, the encoder and every
    # reader recurse, and a RecursionError here once left the call running with no ending.
    if _depth_over(value, RESULT_DEPTH_MAX):
        raise ValueError(f"its result is nested deeper than {RESULT_DEPTH_MAX} levels, which "
                         "the store does not hold")
    # A NUL or a lone surrogate in a string: PostgreSQL's jsonb cannot hold it (see sqljson).
    problem = strings_problem(value, "its result")
    if problem:
        raise ValueError(problem)
    return _RESULT.encode(value)


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


# What ``json.dumps(value, default=_unserialisable, allow_nan=False)`` writes, with its encoder
# made once (``json.dumps`` makes one per call when given options; an encoder keeps no state
# between calls, so one serves every thread). allow_nan=False: NaN would be stored as JSON no
# other reader accepts (the API says null).
_RESULT = json.JSONEncoder(default=_unserialisable, allow_nan=False)


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


def end_unstarted(rt: Runtime, call: ToolCallRow, why: str) -> Outcome:
    """:func:`did_not_run` from a delivery, as the outcome Celery is told of."""
    move = did_not_run_move(call, why)
    if rt.store.transition(move.key, move.to, allowed={CallStatus.QUEUED}, match=move.match,
                           values=move.values, detail=move.detail):
        return Outcome(move.to, move.values["error"])
    return Outcome(None, why=RACED)


def handle_lost_attempt(
    rt: Runtime, key: str, owner: str | None, reason: str, *, republish: bool,
    call: ToolCallRow | None = None,
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
    call = call or rt.store.get_call(key)
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
            message_lost(rt, call.key, "republish_failed")
    log.info("attempt lost, retrying", extra={"action": "attempt_lost", "key": call.key})


def message_lost(rt: Runtime, key: str, action: str) -> None:
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


def exhausted_before_claim(rt: Runtime, call: ToolCallRow, why: str,
                           counted: int | None = None) -> Outcome:
    """A queued retrying call delivered again after every attempt was used (by worker loss).
    ``counted``: the attempts Redis counted (``broker/runs.py``), when more than stored."""
    attempts = max(call.attempts, counted or 0)
    decision = retry.after_worker_lost(
        EffectClass(call.effect), attempts, call.max_attempts, why, key=call.key)
    assert decision.status is not None
    if rt.store.transition(
        call.key, decision.status, allowed={CallStatus.QUEUED},
        match={"attempts": call.attempts},
        values={"error": decision.error, "attempts": attempts},
        detail={"reason": "attempts_exhausted"},
    ):
        return Outcome(decision.status, decision.error)
    return Outcome(None, why=RACED)



def finish(rt: Runtime, key: str, attempt: Attempt | str, to: CallStatus,
           **values: Any) -> bool:
    """End ``attempt``'s call (guarded as :meth:`Attempt.guards` says; a plain owner id is a
    claim stored ``running``); True if this won."""
    if isinstance(attempt, str):
        attempt = Attempt(attempt, 0)
    won = False
    try:
        won = _finish(rt, key, attempt, to, **values)
        return won
    finally:
        # A leased attempt's run ends in Redis once the store has its outcome. The run of an
        # ending that won is dropped by the announcement of that ending, in the same round
        # trip (``announce.ANNOUNCE_SCRIPT``, after the commit), with the call's attempt count;
        # if that announcement is lost (Redis unreachable) the run lapses with its lease, and
        # the reaper finds its call ended. Anything else (a retry, an ending that lost or
        # raised) only releases the run: the call has not ended, and its count must outlive
        # this attempt, which ran, so that the next is numbered after it (an ending that lost
        # to a reaper's record once dropped it, and the next delivery ran as the same number).
        if attempt.leased and not (won and to.terminal):
            release_run(rt, key, attempt.owner)


def _finish(rt: Runtime, key: str, attempt: Attempt, to: CallStatus, **values: Any) -> bool:
    reason = values.pop("reason", None)
    allowed, match, written, started = attempt.guards()

    def move(conn: Connection | None = None) -> bool:
        return rt.store.transition(
            key, to, allowed=allowed, match=match, values={**written, **values},
            detail={"reason": reason} if reason else None, started=started, conn=conn,
        )

    try:
        # Committed with the endings of this process's other threads when they come together.
        return rt.ends.commit(move, move)
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
            key, CallStatus.FAILED, allowed=allowed, match=match,
            values={**written, "error": error}, detail={"reason": "ending_refused"},
            started=started)


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


def end(rt: Runtime, key: str, attempt: Attempt, to: CallStatus, error: str | None,
        reason: str) -> Outcome:
    """End the running ``attempt``: the call becomes ``to`` with ``error``."""
    if finish(rt, key, attempt, to, error=error, reason=reason):
        return Outcome(to, error)
    return Outcome(None, why=SUPERSEDED)



def succeed(rt: Runtime, key: str, attempt: Attempt, value: Any) -> Outcome:
    try:
        dumped = dump_result(value)
    except (TypeError, ValueError) as err:
        # The tool ran; its effect happened even though its result cannot be recorded.
        return end(rt, key, attempt, CallStatus.FAILED, f"the tool ran but {err}",
                   "result_not_json")
    if finish(rt, key, attempt, CallStatus.SUCCEEDED, result=dumped):
        return Outcome(CallStatus.SUCCEEDED)
    return Outcome(None, why=SUPERSEDED)


DUPLICATE = ("duplicate delivery: the call was not queued (another delivery owns it, it has "
              "ended, or it is not in the store)")
RACED = "another delivery or a sweep changed the call first"
SUPERSEDED = ("the tool returned, but its attempt had been ended or taken over meanwhile (its "
               "lease ran out); this attempt's outcome was not recorded")



def error_text(err: BaseException) -> str:
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
