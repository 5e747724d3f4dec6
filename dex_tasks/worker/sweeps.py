"""Periodic jobs run by beat (and by ``dex-tasks sweep``): each takes ``now`` and is idempotent.

Two beats, or a beat and an operator, may run the same job at once: every change goes through
the store's guarded transition, so whoever comes second changes nothing. A short Redis lock per
job only saves the duplicate work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import redis
from sqlalchemy import func, select

from dex_tasks.broker import routing
from dex_tasks.broker.celery_app import publish
from dex_tasks.broker.webhooks import publish as publish_webhooks
from dex_tasks.errors import StoreUnavailableError
from dex_tasks.policy import RETRYING_EFFECTS, EffectClass
from dex_tasks.states import CallStatus
from dex_tasks.store import (
    CALLS,
    Move,
    bounded_statements,
    deadlines,
    readable_calls,
    transcript,
)
from dex_tasks.store import webhooks as webhook_outbox
from dex_tasks.store.calls import unsent
from dex_tasks.store.models import ToolCallRow
from dex_tasks.worker import claims
from dex_tasks.worker.endings import after_lost_attempt, did_not_run_move, lost_attempt_move
from dex_tasks.worker.leased import LEASE_LOST, reap_expired_runs
from dex_tasks.worker.reconcilers import reconcile_with_reconcilers
from dex_tasks.worker.runtime import Runtime

log = logging.getLogger("dex_tasks.worker.sweeps")


# How long the reaper waits, after it has seen the store writable, before it reaps (see the
# comment in reap_expired_leases).
LEASE_SETTLE_SECONDS = 1.0



def reap_expired_leases(rt: Runtime, now: float | None = None, *,
                        settle: float = LEASE_SETTLE_SECONDS) -> int:
    """Finish or requeue running calls whose lease ran out (their worker is gone).

    Leases are judged on the store's clock; ``now`` (a time on that clock) replaces it, for
    tests and operators. Returns how many calls it moved, in one set-based transition, and
    how many leased attempts of the retrying path (leases in Redis, on Redis's clock) it
    found lapsed and recorded (``leased.reap_expired_runs``).
    """
    reaped = _reap_runs(rt)
    # A live worker must never lose its call to the reaper, whatever the clocks say and even
    # while the store stalls.
    #
    # Clocks: the claim and every renewal set ``lease_expires_at`` to the store's time plus
    # ``lease_seconds``, evaluated by the database when the statement runs, and the reaper
    # compares leases with the store's time too (``connections.store_now``). A worker's own
    # clock plays no part, however far off it is. (SQLite's clock is the machine's, which every
    # process that writes the file shares.)
    #
    # Stalls: while another process holds SQLite's write lock for 8 s, or PostgreSQL cannot be
    # reached, the worker's lease renewer waits like every other writer, and leases run out
    # although their workers are alive. The reaper can still read (WAL readers do not wait),
    # sees those leases expired, and would then wait for the lock as well; SQLite's busy
    # handler is not fair, so when the stall ends the reaper could get the lock before the
    # renewer and reap a live call. Three rules make that impossible:
    #
    # 1. The reap is guarded by the lease it found expired (``lease_expires_at = :seen``, with
    #    the owner and the attempt): a renewal that commits first changes the lease, and the
    #    reap of that call changes nothing.
    # 2. Before it reaps, the reaper takes the write lock itself once (``Store.writable_at``:
    #    on PostgreSQL, a round trip) and then waits ``settle`` seconds. At that moment the
    #    store was writable, so every renewer that was waiting gets its turn right after:
    #    SQLite's busy handler retries within 100 ms; a renewer cut off from PostgreSQL
    #    retries within half a second (``store.RETRY_MAX_PAUSE``), and one whose retries ran
    #    out starts again within a quarter second (``hooks.LeaseRenewer``). So when the reaper
    #    reaps, every live worker's renewal has landed and rule 1 turns the reap away; a
    #    worker that is gone renews nothing and its calls are reaped.
    # 3. A renewal grants a whole lease from the store's time when it *runs*, not from when
    #    it was asked for, so a renewal that waited out a stall is not stale on arrival.
    #
    # The price: a dead worker's calls are reaped ``settle`` seconds later, and the probe
    # costs one write transaction, both only when some lease has run out.
    #
    # 4. A forward step of the store's clock (an NTP correction, a VM resumed) makes every
    #    lease look expired at once. The reaper reads the store's clock on each run and
    #    compares its advance with that of its own monotonic clock (``_ClockWatch``); when the
    #    store's ran ahead, or this process has no earlier reading to compare with, it waits a
    #    whole renewal interval instead of ``settle``: every live worker renews in that time,
    #    and rule 1 turns the reaps of their calls away.
    suspect = now is None and _clock_watch.stepped(rt)
    expired = rt.store.expired_leases(now)
    if not expired:
        return reaped
    rt.store.writable_at()
    time.sleep(max(settle, _renewal_grace(rt)) if suspect else settle)
    stamp = time.time()
    moves: dict[str, tuple[ToolCallRow, Move]] = {}
    for call in expired:
        with _one_row("reap_expired_leases", call.key):
            move = lost_attempt_move(call, LEASE_LOST, stamp)
            guard = {**move.match, "lease_expires_at": call.lease_expires_at}
            moves[call.key] = (call, replace(move, match=guard))
    moved = rt.store.transition_many([move for _, move in moves.values()],
                                     allowed={CallStatus.RUNNING}, now=stamp)
    if len(moved) < len(moves):
        log.warning("leases ran out but were renewed before the reap (did the store stall?)",
                    extra={"action": "lease_renewed_late", "count": len(moves) - len(moved)})
    for key in moved:
        call, move = moves[key]
        with _one_row("reap_expired_leases", key):
            after_lost_attempt(rt, call, move, republish=True)
    return reaped + len(moved)


def _reap_runs(rt: Runtime) -> int:
    """The retrying path's part of the reaper; Redis unreachable skips it this time (its
    leases cannot be judged, and nothing about them changes meanwhile)."""
    try:
        return reap_expired_runs(rt)
    except redis.RedisError as err:
        log.warning("leases in Redis not reaped: %s", err, extra={"action": "reap_runs_error"})
        return 0


def _renewal_grace(rt: Runtime) -> float:
    """How long every live worker takes at most to renew its leases: its renewal interval
    (``hooks.LeaseRenewer``) and the reaper's settle time."""
    return max(0.2, rt.settings.lease_seconds / 3) + LEASE_SETTLE_SECONDS


# How far the store's clock may run ahead of the reaper's monotonic clock between two of its
# runs before the reaper takes it for a step (latency and drift stay far below this).
CLOCK_STEP_TOLERANCE = 1.0


class _ClockWatch:
    """The store's clock as the reaper last read it, against this process's monotonic clock,
    per store."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, tuple[float, float]] = {}

    def stepped(self, rt: Runtime) -> bool:
        """True if the store's clock ran ahead since the last reading (or there was none)."""
        store_time, mono = rt.store.store_time(), time.monotonic()
        with self.lock:
            last = self.seen.get(rt.settings.database_url)
            self.seen[rt.settings.database_url] = (store_time, mono)
        if last is None:
            return True
        ahead = (store_time - last[0]) - (mono - last[1])
        if ahead > CLOCK_STEP_TOLERANCE:
            log.warning("the store's clock stepped forward; the reaper waits a renewal "
                        "interval before it reaps", extra={"action": "store_clock_step",
                                                           "seconds": round(ahead, 3)})
            return True
        return False


_clock_watch = _ClockWatch()


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

    A call recorded but never sent (no ``published_at``: its recorder died between the store's
    commit and the publish) is sent once it is ``UNSENT_GRACE_SECONDS`` old, not after
    the window.

    A call republished ``n`` times already waits ``window * 2**n`` (capped at 64 windows)
    before the next republish: a message that is only stuck behind a backlog is not copied
    again every window, while a lost one is still sent again.

    A single-attempt call whose Redis claim was taken long ago but which never reached the
    store's claim belongs to a worker that died between the two: no tool touched it, so it ends
    "did not run" (the store's compare-and-set keeps that safe if the worker is only slow).
    The calls that end are ended together, in one set-based transition; those republished
    are recorded together.
    """
    now = time.time() if now is None else now
    window = rt.settings.republish_after_seconds
    lost_after = min(window, rt.settings.republish_lost_after_seconds)
    served = _served_or_none(rt)
    ending: list[Move] = []
    republished: list[str] = []
    search = routing.MessageSearch(rt.redis)
    # The publish marks this process's own calls are waiting to write (a republisher beside
    # an agent, as in the demo): a call whose mark has not landed yet looks never sent.
    rt.store.flush_publish_marks()
    stranded = rt.store.stranded_queued(now - lost_after)
    running = _running(rt, stranded)
    for call in stranded:
        if call.key in running:
            continue  # queued in the store, running under a lease in Redis
        if served is not None and call.tool not in served:
            # No live worker consumes its queue: a copy would only wait beside the first, and
            # the call ends at its queue deadline (expire_unserved) unless a worker comes.
            continue
        with _one_row("republish_stranded", call.key):
            if _within(call, now, window) and (_within(call, now, lost_after)
                                                or search.holds(routing.queue_for(call.tool),
                                                                call.key)):
                # Inside its window, a call is sent again only once its message is surely
                # gone from Redis (lost in transit to a host a partition cut off), never
                # while it may be waiting in its queue.
                continue
            send, why = _stranded(rt, call, now, lost_after)
            if why is not None:
                ending.append(did_not_run_move(call, why))
            elif send and _republish(rt, call):
                republished.append(call.key)
    rt.store.mark_published(republished, now, republished=True)
    ended = rt.store.transition_many(ending, allowed={CallStatus.QUEUED}, now=now)
    return len(republished) + len(ended)


def _running(rt: Runtime, calls: list[ToolCallRow]) -> set[str]:
    """The keys of ``calls`` (queued in the store) that a retrying attempt runs now, under a
    lease in Redis. Redis unreachable: none (the publish fails too, and is tried again)."""
    retrying = [c.key for c in calls if c.effect in RETRYING_EFFECTS]
    try:
        return set(rt.runs.get_many(retrying))
    except redis.RedisError:
        return set()


def _served_or_none(rt: Runtime) -> set[str] | None:
    """The tools live workers serve; None when Redis cannot tell (then nobody is skipped)."""
    try:
        return routing.live_tools(rt.redis)
    except Exception:  # noqa: BLE001 - Redis down: the publish fails too, and is retried
        return None


def _within(call: ToolCallRow, now: float, window: float) -> bool:
    """True while ``call``'s last publish is less than its (backed-off) ``window`` old."""
    backoff = window * (2 ** min(call.republishes, MAX_REPUBLISH_DOUBLINGS))
    return call.published_at is not None and now - call.published_at < backoff


def _stranded(rt: Runtime, call: ToolCallRow, now: float,
              window: float) -> tuple[bool, str | None]:
    """What to do with a stranded call: (send it again?, why it must end "did not run")."""
    if call.published_at is None:
        if not unsent([call], now):
            return False, None  # its recorder is publishing it
    elif _within(call, now, window):
        return False, None
    if call.expires_at is not None and now > call.expires_at:
        return False, "it expired in the queue before a worker started it"
    if not EffectClass(call.effect).retrying:
        claim = claims.read_claim(rt.redis, call.key)
        if claim is not None:
            if now - float(claim.get("at", 0)) > window:
                return False, "the worker that received it stopped before starting the tool"
            return False, None  # a worker took it a moment ago: its store claim decides
    return True, None


def _republish(rt: Runtime, call: ToolCallRow) -> bool:
    try:
        publish(rt.app, call)
    except Exception:  # noqa: BLE001 - broker down: try again next sweep
        log.warning("republish failed", extra={"action": "republish_failed", "key": call.key})
        return False
    log.info("stranded call republished", extra={"action": "republished", "key": call.key})
    return True


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


def _queued_tools() -> Any:
    """The distinct tools of the queued calls, by a loose index scan (a recursive CTE that
    asks the ``(status, tool, effect)`` index for the next tool after the last): as many
    index probes as there are tools, however many calls are queued, on both engines."""
    queued = CALLS.c.status == CallStatus.QUEUED.value
    tools = select(func.min(CALLS.c.tool).label("tool")).where(queued).cte(
        "queued_tools", recursive=True)
    after = select(func.min(CALLS.c.tool)).where(queued, CALLS.c.tool > tools.c.tool)
    tools = tools.union_all(
        select(after.scalar_subquery()).where(tools.c.tool.is_not(None)))
    return select(tools.c.tool).where(tools.c.tool.is_not(None))


QUEUED_TOOLS = _queued_tools()


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
    with rt.store.read() as conn:
        # Index ranges only, never a walk of the queue: the tools with queued calls first (a
        # loose scan of the (status, tool, ...) index, one probe per tool), then the queued
        # calls of the unserved ones among them. A backlog of served tools is never read
        # (with ``tool NOT IN (served)`` every sweep read every queued call: ~150 ms at 500k
        # queued on PostgreSQL).
        unserved = sorted(set(conn.execute(QUEUED_TOOLS).scalars()) - served)
        calls = readable_calls(conn.execute(
            select(CALLS).where(CALLS.c.status == CallStatus.QUEUED.value,
                                CALLS.c.tool.in_(unserved), overdue).limit(limit)
        ).mappings().all()) if unserved else []
    ending: list[Move] = []
    running = _running(rt, calls)
    for call in calls:
        if call.key in running:
            continue  # its lease in Redis says a worker runs it
        if call.expires_at is not None:
            why = (f"it expired in the queue before a worker started it (no live worker "
                   f"serves the tool {call.tool!r})")
        else:
            why = (f"no live worker serves the tool {call.tool!r}, and the call waited past "
                   f"its queue deadline of {rt.settings.queue_deadline_seconds:g}s")
        with _one_row("expire_unserved", call.key):
            ending.append(did_not_run_move(call, why))
    # One set-based transition: each move keeps did_not_run's attempts guard.
    return len(rt.store.transition_many(ending, allowed={CallStatus.QUEUED}, now=now))


def expire_approvals(rt: Runtime, now: float | None = None) -> int:
    """Reject calls whose approval deadline passed undecided; returns how many."""
    return deadlines.expire_overdue(rt.store, now)


def warn_deadlines(rt: Runtime, now: float | None = None) -> int:
    """Announce ``approval_deadline_near`` (webhooks) for deadlines within the lead time."""
    return deadlines.warn_near_deadlines(rt.store, rt.settings.webhook_deadline_lead_seconds,
                                         now)


def republish_webhooks(rt: Runtime, now: float | None = None) -> int:
    """Send again the webhook deliveries still pending that no worker touched for longer than
    any retry waits (a publish lost, a worker gone with its retry); returns how many."""
    now = time.time() if now is None else now
    quiet = (rt.settings.webhook_backoff_max_seconds + rt.settings.webhook_timeout_seconds
             + rt.settings.republish_after_seconds)
    ids = webhook_outbox.stale_pending(rt.store, now - quiet)
    if ids:
        publish_webhooks(rt.app, ids)
    return len(ids)


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
    # Bounded: at most RECONCILE_PER_PASS checkers per pass, the next pass going on where this
    # one stopped (a cursor in Redis; without Redis, from the oldest again), so that a slow
    # checker holds one worker slot for a bounded time and every call gets its turn.
    after: tuple[float, str] | None = None
    try:
        raw = rt.redis.get(_RECONCILE_CURSOR)
        if raw:
            at, _, key = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(" ")
            after = (float(at), key)
    except Exception:  # noqa: BLE001 - no cursor: start from the oldest
        after = None
    result = reconcile_with_reconcilers(rt.store, None, now, after=after,
                                        limit=RECONCILE_PER_PASS)
    try:
        if result.stopped_after is None:
            rt.redis.delete(_RECONCILE_CURSOR)
        else:
            at_, key_ = result.stopped_after
            rt.redis.set(_RECONCILE_CURSOR, f"{at_!r} {key_}", ex=3600)
    except Exception:  # noqa: BLE001 - the next pass starts from the oldest
        log.warning("reconcile cursor not saved", extra={"action": "sweep_lock_error",
                                                         "job": "reconcile_unknown"})
    return len(result.reported)


# How many checkers one reconcile_unknown pass asks at most (see reconcile_unknown).
RECONCILE_PER_PASS = 20
_RECONCILE_CURSOR = "dex:reconcile-cursor"


JOBS: dict[str, Callable[..., int]] = {
    "expire_approvals": expire_approvals,
    "warn_deadlines": warn_deadlines,
    "republish_webhooks": republish_webhooks,
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
    with _job_lock(rt, job) as got_lock:
        if not got_lock:
            return 0
        # Every transaction of a sweep is bounded: one stuck behind a lock a vanished host's
        # session holds fails in seconds and runs again next turn; it never queues (issue 19).
        with bounded_statements(rt.settings.sweep_statement_timeout_seconds,
                                rt.settings.sweep_lock_timeout_seconds):
            count = fn(rt, now)
    # Most runs find nothing to do, every few seconds on every beat: only work is news.
    log.log(logging.INFO if count else logging.DEBUG, "sweep done",
            extra={"action": "sweep", "job": job, "count": count})
    try:
        from dex_tasks.broker.metrics import record_sweep

        record_sweep(rt.redis, job, count)
    except Exception:  # noqa: BLE001 - statistics must never fail a sweep
        log.warning("sweep stats not recorded", extra={"action": "sweep_stats_error",
                                                       "job": job})
    return count


@contextmanager
def _job_lock(rt: Runtime, job: str) -> Iterator[bool]:
    """Hold the job's Redis lock for the whole pass; yields False if another pass holds it.

    The lock lasts one sweep interval and a thread renews it while the pass runs: a lock that
    simply expired after one interval let passes longer than that overlap (40 unknown calls
    with a slow checker took every worker slot, one reconcile pass started per beat tick). It
    is released only by its holder (redis-py's token lock), so a pass never frees another's.
    Redis unreachable: the pass runs without it (the lock only saves duplicate work).
    """
    ttl = max(1.0, rt.settings.sweep_interval_seconds)
    lock = rt.redis.lock(f"dex:sweep-lock:{job}", timeout=ttl, blocking=False,
                         thread_local=False)
    try:
        got = bool(lock.acquire())
    except Exception:  # noqa: BLE001 - the lock only saves work; run without it
        log.warning("sweep lock unavailable", extra={"action": "sweep_lock_error", "job": job})
        yield True
        return
    if not got:
        yield False
        return
    done = threading.Event()

    def renew() -> None:
        while not done.wait(ttl / 3):
            try:
                lock.reacquire()
            except Exception:  # noqa: BLE001 - lost or unreachable: the pass goes on
                log.warning("sweep lock not renewed", extra={"action": "sweep_lock_error",
                                                             "job": job})
    renewer = threading.Thread(target=renew, name=f"dex-sweep-lock-{job}", daemon=True)
    renewer.start()
    try:
        yield True
    finally:
        done.set()
        renewer.join()
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - it expired or Redis is gone: nothing to free
            pass


def run_all(rt: Runtime, now: float | None = None) -> dict[str, int]:
    """Run every job once (``dex-tasks sweep``)."""
    return {job: run_job(rt, job, now) for job in JOBS}
