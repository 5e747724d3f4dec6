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

from dex_tasks import approvals, claims, transcript
from dex_tasks.celery_app import publish
from dex_tasks.errors import StoreUnavailableError
from dex_tasks.execution import Runtime, did_not_run, handle_lost_attempt
from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass
from dex_tasks.reconcile import reconcile_with_reconcilers

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
    acted = 0
    for call in rt.store.stranded_queued(now - window):
        with _one_row("republish_stranded", call.key):
            acted += _republish_one(rt, call, now, window)
    return acted


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

    Runs in a worker (beat sends it as a task), where the tool modules are imported.
    """
    return len(reconcile_with_reconcilers(rt.store, None, now).reported)


JOBS: dict[str, Callable[..., int]] = {
    "expire_approvals": expire_approvals,
    "deliver_messages": deliver_messages,
    "reap_expired_leases": reap_expired_leases,
    "republish_stranded": republish_stranded,
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
