"""Periodic jobs run by beat (and by ``dex-tasks sweep``): each takes ``now`` and is idempotent.

Two beats, or a beat and an operator, may run the same job at once: every change goes through
the store's guarded transition, so whoever comes second changes nothing. A short Redis lock per
job only saves the duplicate work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import func, select

from dex_tasks import approvals, claims, routing, transcript
from dex_tasks.celery_app import publish
from dex_tasks.errors import StoreUnavailableError
from dex_tasks.execution import Runtime, did_not_run, handle_lost_attempt
from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass
from dex_tasks.reconcile import reconcile_with_reconcilers
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, readable_calls

log = logging.getLogger("dex_tasks.sweeps")


def reap_expired_leases(rt: Runtime, now: float | None = None) -> int:
    """Finish or requeue running calls whose lease ran out (their worker is gone).

    Returns how many calls it moved.
    """
    now = time.time() if now is None else now
    moved = 0
    for call in rt.store.expired_leases(now):
        with _one_row("reap_expired_leases", call.key):
            status = handle_lost_attempt(
                rt, call.key, call.worker,
                "the worker running the tool stopped renewing its lease (presumed lost)",
                republish=True,
            )
            moved += status is not None
    return moved


@contextmanager
def _one_row(job: str, key: str) -> Iterator[None]:
    """Log and skip a call a sweep cannot handle, so the rest of its batch is still handled.

    The store being down is not such a call: that ends the whole sweep (it runs again on the
    next beat tick).
    """
    try:
        yield
    except StoreUnavailableError:
        raise
    except Exception as err:
        log.error("sweep skipped a call it could not handle", exc_info=True, extra={
            "action": "sweep_row_failed", "job": job, "key": ascii(key[:120]),
            "error": f"{type(err).__name__}: {err}"})


MAX_REPUBLISH_DOUBLINGS = 6


def republish_stranded(rt: Runtime, now: float | None = None) -> int:
    """Republish queued calls whose message seems lost; returns how many it acted on.

    A call republished ``n`` times already waits ``window * 2**n`` (capped at 64 windows)
    before the next republish: a message that is only stuck behind a backlog is not copied
    again every window, while a lost one is still sent again.

    A single-attempt call whose Redis claim was taken long ago but which never reached the
    store's claim belongs to a worker that died between the two: no tool touched it, so it ends
    "did not run" (the store's compare-and-set keeps that safe if the worker is only slow).
    """
    now = time.time() if now is None else now
    window = rt.settings.republish_after_seconds
    served = _served_or_none(rt)
    acted = 0
    for call in rt.store.stranded_queued(now - window):
        if served is not None and call.tool not in served:
            # No live worker consumes its queue: a copy would only wait beside the first, and
            # the call ends at its queue deadline (expire_unserved) unless a worker comes.
            continue
        with _one_row("republish_stranded", call.key):
            acted += _republish_one(rt, call, now, window)
    return acted


def _served_or_none(rt: Runtime) -> set[str] | None:
    """The tools live workers serve; None when Redis cannot tell (then nobody is skipped)."""
    try:
        return routing.live_tools(rt.redis)
    except Exception:  # noqa: BLE001 - Redis down: the publish fails too, and is retried
        return None


def _republish_one(rt: Runtime, call: ToolCallRow, now: float, window: float) -> int:
    backoff = window * (2 ** min(call.republishes, MAX_REPUBLISH_DOUBLINGS))
    if call.published_at is not None and now - call.published_at < backoff:
        return 0
    if call.expires_at is not None and now > call.expires_at:
        return int(did_not_run(rt.store, call,
                               "it expired in the queue before a worker started it"))
    if not EffectClass(call.effect).retrying:
        claim = claims.read_claim(rt.redis, call.key)
        if claim is not None:
            if now - float(claim.get("at", 0)) > window:
                return int(did_not_run(
                    rt.store, call,
                    "the worker that received it stopped before starting the tool",
                ))
            return 0
    try:
        publish(rt.app, call)
    except Exception:  # noqa: BLE001 - broker down: try again next sweep
        log.warning("republish failed", extra={"action": "republish_failed", "key": call.key})
        return 0
    rt.store.mark_published(call.key, now, republished=True)
    log.info("stranded call republished", extra={"action": "republished", "key": call.key})
    return 1


def restore_orphaned_messages(rt: Runtime, now: float | None = None) -> int:
    """Put back on their queues the messages a vanished worker held; returns how many.

    A worker SIGKILLed as a whole leaves the messages it had received and not finished in
    kombu's ``unacked`` hash (reserved, running late-acked, waiting out a retry's countdown),
    where only the visibility timeout (an hour) would hand them back. Live workers list the
    messages they hold every beat (``routing.Presence``); a message unacked for longer than a
    worker's announcement lasts, and held by nobody, is restored (``routing.restore_orphans``).
    """
    now = time.time() if now is None else now
    ttl = routing.presence_ttl(rt.settings.worker_heartbeat_seconds)
    held = routing.held_tags(rt.redis)
    return routing.restore_orphans(rt.app, held, received_before=now - ttl)


def expire_unserved(rt: Runtime, now: float | None = None, limit: int = 500) -> int:
    """End "did not run" the queued calls whose tool no live worker serves, once their queue
    deadline passed: ``expires_at`` when the call gave ``expires_in``, else
    ``DEX_QUEUE_DEADLINE_SECONDS`` after its message was sent. Returns how many.

    A call whose tool some live worker serves is never ended here, however long it waits (a
    backlog is not a missing worker). Redis unreachable, or restarted too recently for every
    live worker to have announced itself again: nothing is ended (it cannot tell).
    """
    now = time.time() if now is None else now
    if not routing.announcements_complete(rt.redis, rt.settings.worker_heartbeat_seconds):
        return 0
    served = routing.live_tools(rt.redis)
    queued_since = func.coalesce(CALLS.c.published_at, CALLS.c.created_at)
    overdue = (CALLS.c.expires_at < now) | (
        CALLS.c.expires_at.is_(None) & (queued_since < now - rt.settings.queue_deadline_seconds))
    stmt = select(CALLS).where(CALLS.c.status == CallStatus.QUEUED.value, overdue)
    if served:
        stmt = stmt.where(CALLS.c.tool.not_in(sorted(served)))
    with rt.store.read() as conn:
        calls = readable_calls(conn.execute(stmt.limit(limit)).mappings().all())
    ended = 0
    for call in calls:
        if call.expires_at is not None:
            why = (f"it expired in the queue before a worker started it (no live worker "
                   f"serves the tool {call.tool!r})")
        else:
            why = (f"no live worker serves the tool {call.tool!r}, and the call waited past "
                   f"its queue deadline of {rt.settings.queue_deadline_seconds:g}s")
        with _one_row("expire_unserved", call.key):
            ended += did_not_run(rt.store, call, why)
    return ended


def expire_approvals(rt: Runtime, now: float | None = None) -> int:
    """Reject calls whose approval deadline passed undecided; returns how many."""
    return approvals.expire_overdue(rt.store, now)


def deliver_messages(rt: Runtime, now: float | None = None) -> int:
    """Deliver queued user messages whose turn is over (a safety net: ending a turn's last
    call delivers them in the same transaction); returns how many."""
    return transcript.deliver_messages(rt.store, now)


def reconcile_unknown(rt: Runtime, now: float | None = None) -> int:
    """Run the registered checkers (``@tool.reconciler``) of the tools imported here for
    ``outcome_unknown`` calls not reported yet; returns how many reports it sent.

    The one job that runs tool code (the checkers): beat sends it to the workers, where the
    tool modules are imported, on a queue of its own (``celery_app.RECONCILE_QUEUE``), so it
    is sandboxed like a tool and no checker can stall the other sweeps. It may wait for a
    free slot; nothing it does has a deadline (its calls are terminal already).
    """
    return len(reconcile_with_reconcilers(rt.store, None, now).reported)


JOBS: dict[str, Callable[..., int]] = {
    "expire_approvals": expire_approvals,
    "deliver_messages": deliver_messages,
    "reap_expired_leases": reap_expired_leases,
    "republish_stranded": republish_stranded,
    "restore_orphaned_messages": restore_orphaned_messages,
    "expire_unserved": expire_unserved,
    "reconcile_unknown": reconcile_unknown,
}


def run_job(rt: Runtime, job: str, now: float | None = None) -> int:
    """Run one named job, under a short lock so concurrent runs do not duplicate work."""
    try:
        fn = JOBS[job]
    except KeyError:
        raise ValueError(f"unknown sweep job {job!r}; known: {', '.join(sorted(JOBS))}") from None
    lock = f"dex:sweep-lock:{job}"
    ttl = max(1, int(rt.settings.sweep_interval_seconds))
    got_lock = True
    try:
        got_lock = bool(rt.redis.set(lock, "1", nx=True, ex=ttl))
    except Exception:  # noqa: BLE001 - the lock only saves work; run without it
        log.warning("sweep lock unavailable", extra={"action": "sweep_lock_error", "job": job})
    if not got_lock:
        return 0
    try:
        count = fn(rt, now)
    finally:
        try:
            rt.redis.delete(lock)
        except Exception:  # noqa: BLE001
            pass
    # Most runs find nothing to do, every few seconds on every beat: only work is news.
    log.log(logging.INFO if count else logging.DEBUG, "sweep done",
            extra={"action": "sweep", "job": job, "count": count})
    try:
        from dex_tasks.metrics import record_sweep

        record_sweep(rt.redis, job, count)
    except Exception:  # noqa: BLE001 - statistics must never fail a sweep
        log.warning("sweep stats not recorded", extra={"action": "sweep_stats_error",
                                                       "job": job})
    return count


def run_all(rt: Runtime, now: float | None = None) -> dict[str, int]:
    """Run every job once (``dex-tasks sweep``)."""
    return {job: run_job(rt, job, now) for job in JOBS}
