"""Lost attempts of the retrying path, whose ``running`` is a lease in Redis (DESIGN version 4).

A retrying call (``read``, ``idempotent_write``) runs while the store still says ``queued``;
its attempt is a run in Redis (``broker/runs.py``): owner, attempt number, a lease the worker's
main process renews. When that attempt is lost (its child killed, its thread abandoned at a
hard time limit, its whole worker gone and the lease lapsed) :func:`lost_run` records it in the
store, still without a status change while attempts are left (the attempt counted, its start
and loss as events, the call sent again), or ends the call as its effect class says once they
ran out. :func:`handle_lost` picks that or the single-attempt path's
``endings.handle_lost_attempt`` for a call; :func:`reap_expired_runs` is the reaper's part for
leases that lapsed.
"""

from __future__ import annotations

import logging
import time

from dex_tasks.broker.runs import Run
from dex_tasks.policy import RETRYING_EFFECTS, EffectClass
from dex_tasks.states import CallStatus
from dex_tasks.store import Move, Started
from dex_tasks.store.models import ToolCallRow
from dex_tasks.worker import retry
from dex_tasks.worker.endings import after_lost_attempt, handle_lost_attempt, release_run
from dex_tasks.worker.runtime import Runtime

log = logging.getLogger("dex_tasks.worker.execution")

LEASE_LOST = "the worker running the tool stopped renewing its lease (presumed lost)"


def handle_lost(rt: Runtime, key: str, owner: str | None, reason: str, *,
                republish: bool) -> CallStatus | None:
    """A running attempt of ``key`` under ``owner`` is gone: record it, on whichever path the
    call runs. Returns the status it moved the call to (``queued`` for a retry), or None when
    the attempt had already ended or been taken over."""
    call = rt.store.get_call(key)
    if call is None:
        return None
    if call.status == CallStatus.QUEUED.value and call.effect in RETRYING_EFFECTS:
        if owner is None:
            return None  # which child ran it is unknown: its lease lapses, the reaper decides
        return lost_run(rt, call, owner, reason, republish=republish)
    return handle_lost_attempt(rt, key, owner, reason, republish=republish, call=call)


def lost_run(rt: Runtime, call: ToolCallRow, owner: str, reason: str, *, republish: bool,
             run: Run | None = None) -> CallStatus | None:
    """Record the loss of ``owner``'s leased attempt of ``call`` (queued in the store).

    ``run``: the run the reaper already took from Redis; otherwise it is read, and nothing
    happens unless ``owner`` holds it. With attempts left the store counts the attempt (no
    status change) and, with ``republish``, the call is sent again; without, the call ends
    as its effect class says after a worker loss. The run is dropped from Redis after that.
    """
    taken = run is not None
    run = run or rt.runs.get(call.key)
    if run is None or run.worker != owner:
        return None
    now = time.time()
    attempts = max(call.attempts, run.attempt)
    decision = retry.after_worker_lost(EffectClass(call.effect), attempts, call.max_attempts,
                                       reason, key=call.key)
    detail = {"reason": "attempt_lost", "attempt": attempts, "why": reason}
    started = run.started if run.started is not None else now
    try:
        if decision.retry:
            to = CallStatus.QUEUED
            recorded = rt.store.record_attempt(
                call.key, stored=call.attempts, attempt=attempts, owner=run.worker,
                started=started, detail=detail, published_at=now)
        else:
            assert decision.status is not None
            to = decision.status
            recorded = rt.store.transition(
                call.key, to, allowed={CallStatus.QUEUED}, match={"attempts": call.attempts},
                values={"error": decision.error, "attempts": attempts, "worker": run.worker},
                detail=detail,
                started=Started(started, {"attempt": attempts, "worker": run.worker}))
    finally:
        if not taken:
            release_run(rt, call.key, run.worker)
    if not recorded:
        return None
    after_lost_attempt(rt, call, Move(call.key, to), republish=republish)
    return to


def reap_expired_runs(rt: Runtime, limit: int = 500) -> int:
    """Record the leased attempts whose lease lapsed (their worker is gone or stopped): each
    call is sent again while attempts are left, or ended. Returns how many it recorded.

    The lease runs on Redis's clock, and a run is taken from Redis only if its lease is still
    lapsed then (``Runs.reap``), so a worker that renews in time keeps its attempt."""
    reaped = 0
    for key in rt.runs.expired(limit):
        run = rt.runs.reap(key)
        if run is None:
            continue  # renewed or ended meanwhile
        call = rt.store.get_call(key)
        if call is None or call.status != CallStatus.QUEUED.value:
            continue  # it ended (the attempt's own ending won)
        if lost_run(rt, call, run.worker, LEASE_LOST, republish=True, run=run) is not None:
            reaped += 1
    return reaped
