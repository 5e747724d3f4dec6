"""Claims and leases: a call's move to ``running``, its lease, and the reads that find lost work.

The claim is the guarded transition to ``running`` (it writes its event through
``Transitions._record`` like every other move); a lease runs on the store's clock
(``connections.store_now``), never on a worker's, and the worker's main process renews it.
The reaper and the republisher read expired leases and stranded queued calls here.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Float, String, bindparam, literal, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

from dex_tasks.states import CallStatus
from dex_tasks.store import driver
from dex_tasks.store.calls import UNSENT_GRACE_SECONDS
from dex_tasks.store.connections import store_now
from dex_tasks.store.models import ToolCallRow
from dex_tasks.store.moves import CLAIMABLE, single_statement
from dex_tasks.store.tables import (
    CALLS,
    INSERT_EVENT,
    event_name,
    readable_calls,
    status_by_key,
)
from dex_tasks.store.transitions import Transitions

V = TypeVar("V")
log = logging.getLogger("dex_tasks.store")

# The claim, queued -> running, returns the whole row: a worker needs no read before it. The
# lease runs on the store's clock (``connections.store_now``), never on the worker's.
_CLAIM = (
    update(CALLS)
    .where(CALLS.c.key == bindparam("c_key"), CALLS.c.status == CallStatus.QUEUED.value,
           *CLAIMABLE)
    .values(prev_status=CALLS.c.status, status=CallStatus.RUNNING.value,
            attempts=CALLS.c.attempts + 1, worker=bindparam("c_worker"),
            lease_expires_at=store_now() + bindparam("c_lease"),
            updated_at=bindparam("c_now"))
    .returning(*CALLS.c)
)

_FROM_QUEUED = frozenset({CallStatus.QUEUED})
# PostgreSQL: ``mark_published``'s UPDATE with its keys bound as one array, so that it is one
# statement text whatever the number of keys, compiled once and prepared on the server
# (``driver.run``). An ``IN`` list is a new text for each number of keys, compiled and
# expanded by SQLAlchemy on every write: about 1 ms of the marks thread's CPU a write on
# this project's 2-core machine, against 0.3-0.5 ms this way (issue 29).
_MARK_PUBLISHED = (
    update(CALLS)
    .where(CALLS.c.key == bindparam("m_keys", type_=ARRAY(String)).any_(),
           CALLS.c.status == CallStatus.QUEUED.value,
           or_(CALLS.c.published_at.is_(None),
               CALLS.c.published_at < bindparam("m_at", type_=Float)))
    .values(published_at=bindparam("m_at", type_=Float))
)
# Keys per UPDATE of the publish marks.
_MARKS_CHUNK = 500
# How old a mark is when the marks thread writes it. Most calls end by then: the UPDATE
# matches only calls still queued, so the mark of a call that ended writes nothing. A mark
# that does write is a new version of the call's row with an entry in each of its indexes
# (``published_at`` is indexed, so it is never a HOT update): about 500 of a call's 3,300 WAL
# bytes on PostgreSQL, for calls of a 0.1 s tool, when every mark was written after 50 ms
# (issue 29). A mark is read only once its call is ``calls.UNSENT_GRACE_SECONDS`` (2 s) old,
# well beyond this; one written later still only costs a second message, which the claims
# turn away.
MARKS_LINGER_SECONDS = 0.5
# The least time between two writes of marks. Without it the thread woke for every call and
# wrote one UPDATE each, a durable commit per call on PostgreSQL that competed with the
# caller's own inserts (0.4 ms of call_tool's p50 of 1.2 ms, one call at a time); with it,
# calls sent one after another share one UPDATE. At 0.05 s a producer sending 500 calls a
# second still wrote 20 UPDATEs a second, about 0.1 ms of its CPU per call on PostgreSQL
# (issue 29, DESIGN's workload); a mark still lands within LINGER + INTERVAL (0.75 s), well
# inside ``calls.UNSENT_GRACE_SECONDS``.
MARKS_INTERVAL_SECONDS = 0.25


class _PublishMarks:
    """The publish marks of :meth:`Leases.mark_published_soon`, written by a thread of their
    own once they are :data:`MARKS_LINGER_SECONDS` old, at most every
    :data:`MARKS_INTERVAL_SECONDS`, unless a batch fills or a flush asks for them. Each batch
    is written with the time of its oldest mark."""

    def __init__(self, store: Leases) -> None:
        self.store = store
        self.pid = os.getpid()
        self.cond = threading.Condition()
        # Each key's mark: its publish time, and when it was given (monotonic: a wall clock
        # set back must not hold marks until it catches up).
        self.pending: dict[str, tuple[float, float]] = {}
        self.writing = False
        self.flushing = 0
        self.thread: threading.Thread | None = None

    def add(self, keys: Sequence[str], now: float) -> None:
        with self.cond:
            idle = not self.pending
            given = time.monotonic()
            for key in keys:
                self.pending.setdefault(key, (now, given))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="dex-publish-marks",
                                               daemon=True)
                self.thread.start()
                # A process that ends without closing its store still writes its marks.
                atexit.register(self.flush, 2.0)
            # Wake the thread only when it waits for a first mark or a batch is full: waking
            # it for every call would cost the caller a thread switch each.
            if idle or len(self.pending) >= _MARKS_CHUNK:
                self.cond.notify_all()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout``) until every mark given so far is written."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.flushing += 1
            self.cond.notify_all()
            try:
                while self.pending or self.writing:
                    left = deadline - time.monotonic()
                    if left <= 0 or self.thread is None or not self.thread.is_alive():
                        return
                    self.cond.wait(left)
            finally:
                self.flushing -= 1

    def _run(self) -> None:
        while True:
            with self.cond:
                batch = self._next_batch()
                self.writing = True
            try:
                self.store.mark_published(list(batch), min(batch.values()))
            except Exception:  # the calls look unsent: the republisher sends them again
                log.warning("could not record that calls were published", exc_info=True,
                            extra={"action": "mark_published_failed", "count": len(batch)})
            finally:
                with self.cond:
                    self.writing = False
                    self.cond.notify_all()
            # No write follows sooner (a flush or a full batch does not wait).
            with self.cond:
                pause = time.monotonic() + MARKS_INTERVAL_SECONDS
                while (not self.flushing and len(self.pending) < _MARKS_CHUNK
                       and (left := pause - time.monotonic()) > 0):
                    self.cond.wait(left)

    def _next_batch(self) -> dict[str, float]:
        """Under the lock: wait for marks, then until the oldest is due (or a batch is full,
        or a flush asks), and take the marks that are due (all of them, for a flush or a full
        batch), oldest first."""
        while True:
            while not self.pending:
                self.cond.wait()
            marks = itertools.islice(self.pending.items(), _MARKS_CHUNK)
            if self.flushing or len(self.pending) >= _MARKS_CHUNK:
                due = list(marks)
            else:
                # Marks come in the order they were given: the first is the oldest.
                cutoff = time.monotonic() - MARKS_LINGER_SECONDS
                due = [(key, mark) for key, mark in marks if mark[1] <= cutoff]
                if not due:
                    oldest = next(iter(self.pending.values()))[1]
                    self.cond.wait(max(oldest - cutoff, 0.001))
                    continue
            for key, _ in due:
                del self.pending[key]
            return {key: published for key, (published, _) in due}


def _marks(store: Leases) -> _PublishMarks:
    """The store's publish marks in this process (a forked child starts its own)."""
    marks: _PublishMarks | None = store.__dict__.get("_publish_marks")
    if marks is None or marks.pid != os.getpid():
        marks = store.__dict__["_publish_marks"] = _PublishMarks(store)
    return marks


class Leases(Transitions):
    """The claim, lease renewals and the reads of lost work of :class:`~dex_tasks.store.Store`."""

    def claim(self, key: str, owner: str, lease_seconds: float, vet: Callable[[Any], V], *,
              now: float | None = None) -> tuple[Any, V] | None:
        """queued -> running for ``owner``, in one statement that returns the whole row.

        ``None`` when the call is not queued (a duplicate delivery, a call that ended, or no
        such call), or is queued but cannot be claimed (``moves.CLAIMABLE``: it expired
        in the queue by ``now``, or has no attempt left), which its caller tells apart by
        reading it. The row's ``attempts`` counts the attempt this claim starts, and its lease
        runs ``lease_seconds`` on the store's clock. ``vet(row)`` runs inside the transaction
        before the event is written: whatever it raises rolls the claim back (the call stays
        queued, untouched) and propagates. Returns the row and what ``vet`` returned. Retried
        across a lost connection like :meth:`transition`.
        """
        now = time.time() if now is None else now
        if self.is_postgres:
            return self._claim_single(key, owner, lease_seconds, vet, now)
        params = {"c_key": key, "c_worker": owner, "c_lease": lease_seconds, "c_now": now}

        def attempt(tx: Connection, n: int) -> tuple[Any, V] | None:
            rows = driver.run(tx, _CLAIM, params)  # prepared on the DB-API connection
            row = rows[0] if rows else None
            if row is None:
                landed = n > 1 and self._landed(tx, key, CallStatus.RUNNING,
                                                {"worker": owner, "updated_at": now}, now)
                return (landed, vet(landed)) if landed else None
            vetted = vet(row)
            self._record(tx, CallStatus.RUNNING, [row],
                         {key: {"attempt": row.attempts, "worker": owner}}, now, locked=False)
            return row, vetted

        return self._retrying(attempt)

    def _claim_single(self, key: str, owner: str, lease_seconds: float,
                      vet: Callable[[Any], V], now: float) -> tuple[Any, V] | None:
        """PostgreSQL's claim: the guarded move to ``running`` and its event as one statement
        in autocommit (``moves.single_statement``), then ``vet`` on the row it
        returned. The claim has committed by then, so a call ``vet`` refuses is moved back to
        ``queued`` as it was (its attempt uncounted, no owner, no lease), guarded on this
        claim's owner and attempt, before what ``vet`` raised propagates: the caller sees it
        queued and untouched, as the transaction form's rollback leaves it."""
        written = {"worker": owner, "updated_at": now}
        stmt = single_statement(CallStatus.RUNNING, _FROM_QUEUED, (), tuple(sorted(written)),
                                 claim=True)
        row = self._move_single(stmt, {"t_key": key, "c_lease": lease_seconds, "c_now": now,
                                       "v_worker": owner, "v_updated_at": now},
                                key, CallStatus.RUNNING, None, now, {}, written)
        if row is None:
            return None
        try:
            return row, vet(row)
        except BaseException:
            self.transition(key, CallStatus.QUEUED, allowed={CallStatus.RUNNING},
                            match={"worker": owner, "attempts": row.attempts},
                            values={"attempts": row.attempts - 1, "worker": None,
                                    "lease_expires_at": None},
                            detail={"reason": "claim_refused"})
            raise

    def record_attempt(self, key: str, *, stored: int, attempt: int, owner: str,
                       started: float, detail: Mapping[str, Any], published_at: float,
                       now: float | None = None) -> bool:
        """Count a leased attempt of a retrying call that did not end it (a transient error,
        a lost worker with attempts left): ``attempts`` becomes ``attempt`` and
        ``published_at`` the time its next message is due, guarded on the call being queued
        with ``stored`` attempts, and the attempt's start and its return to ``queued`` (with
        ``detail``) are written as events. No status changes: the call was ``queued`` in the
        store throughout (its ``running`` was a lease in Redis). True if this wrote it."""
        now = time.time() if now is None else now
        stmt = (update(CALLS)
                .where(CALLS.c.key == key, CALLS.c.status == CallStatus.QUEUED.value,
                       CALLS.c.attempts == stored)
                .values(attempts=attempt, published_at=published_at, updated_at=now)
                .returning(CALLS.c.session_id))
        queued, running = CallStatus.QUEUED.value, CallStatus.RUNNING.value

        def write(tx: Connection, n: int) -> bool:
            row = tx.execute(stmt).first()
            if row is None:
                return n > 1 and self._landed(tx, key, CallStatus.QUEUED,
                                              {"attempts": attempt, "updated_at": now},
                                              now) is not None
            base = {"session_id": row.session_id, "key": key}
            tx.execute(INSERT_EVENT, [
                {**base, "event": event_name(CallStatus.RUNNING), "from_status": queued,
                 "to_status": running, "created_at": started,
                 "detail": json.dumps({"attempt": attempt, "worker": owner})},
                {**base, "event": event_name(CallStatus.QUEUED), "from_status": running,
                 "to_status": queued, "created_at": now,
                 "detail": json.dumps(dict(detail), default=str)},
            ])
            return True

        return self._retrying(write)

    def mark_published(self, keys: str | Sequence[str], now: float | None = None, *,
                       republished: bool = False) -> None:
        """Record when a message for queued calls was last published (not a status change).

        ``republished`` counts a republish by the stranded-call sweep, which backs off on
        calls it has already republished.

        A call whose publish time is already later is left as it is: a mark written late (by
        :meth:`mark_published_soon`'s thread) must not move back the time of a message sent
        since, such as a retry's that a worker scheduled for later, which then looked stranded
        to the republisher and was sent twice.
        """
        keys = [keys] if isinstance(keys, str) else list(keys)
        if not keys:
            return
        at = time.time() if now is None else now
        if self.is_postgres and not republished:
            params = {"m_keys": keys, "m_at": at}
            self._retrying(lambda conn, _: driver.run(conn, _MARK_PUBLISHED, params),
                           single=True)
            return
        values: dict[str, Any] = {"published_at": at}
        if republished:
            values["republishes"] = CALLS.c.republishes + 1
        stmt = (update(CALLS)
                .where(CALLS.c.key.in_(keys),
                       status_by_key(self.is_sqlite) == CallStatus.QUEUED.value,
                       or_(CALLS.c.published_at.is_(None), CALLS.c.published_at < at))
                .values(**values))
        self._retrying(lambda conn, _: conn.execute(stmt), single=True)

    def mark_published_soon(self, keys: Sequence[str]) -> None:
        """:meth:`mark_published` off the caller's path: a thread of this store marks the keys
        given since its last write in one UPDATE, so ``call_tool`` returns once its message is
        sent, and a burst of calls costs a few UPDATEs instead of one each.

        Until its mark lands a call looks never sent, which only the republisher and a repeat
        of the request read, and only once the call is ``calls.UNSENT_GRACE_SECONDS`` old: a
        mark later than that (a stalled store, a process killed first) costs a second message,
        which the claims turn away. :meth:`close` writes what is left."""
        _marks(self).add(keys, time.time())

    def mark_sent(self, calls: Sequence[Any], now: float | None = None) -> None:
        """Record that the messages of new ``calls`` (rows with ``key`` and ``created_at``)
        just left: through :meth:`mark_published_soon`, except for a call old enough that
        the republisher or a repeat of its request may already take it for one never sent
        (a re-send of a call whose recorder died, see ``calls.UNSENT_GRACE_SECONDS``), which
        is marked before this returns, so that it is not sent a second time meanwhile."""
        now = time.time() if now is None else now
        late = now - UNSENT_GRACE_SECONDS / 2
        if old := [c.key for c in calls if c.created_at <= late]:
            self.mark_published(old, now)
        if young := [c.key for c in calls if c.created_at > late]:
            self.mark_published_soon(young)

    def flush_publish_marks(self) -> None:
        """Wait until the marks of :meth:`mark_published_soon` given so far are written."""
        marks: _PublishMarks | None = self.__dict__.get("_publish_marks")
        if marks is not None:
            marks.flush()

    def close(self) -> None:
        self.flush_publish_marks()
        super().close()

    def mark_unpublished(self, keys: str | Sequence[str]) -> None:
        """Record that queued calls' messages are lost (a publish failed, or the delivery that
        took one could not claim it): ``published_at`` is cleared, so the republisher sends
        them on its next turn (never-published calls come first and wait no window)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        if not keys:
            return
        stmt = (update(CALLS)
                .where(CALLS.c.key.in_(keys),
                       status_by_key(self.is_sqlite) == CallStatus.QUEUED.value)
                .values(published_at=None))
        self._retrying(lambda conn, _: conn.execute(stmt), single=True)

    def renew_leases(self, worker_prefix: str, keys: Sequence[str], seconds: float) -> int:
        """Extend the leases of ``keys`` still running on this worker to ``seconds`` from now
        on the store's clock; returns rows touched.

        "Now" is when the statement runs, so a renewal that waited for a lock or a reconnect
        still grants a whole lease. Retried across a lost connection (running it twice only
        extends the leases again).
        """
        if not keys:
            return 0
        stmt = (
            update(CALLS)
            .where(
                CALLS.c.key.in_(list(keys)),
                status_by_key(self.is_sqlite) == CallStatus.RUNNING.value,
                CALLS.c.worker.like(worker_prefix + "%"),
            )
            .values(lease_expires_at=store_now() + seconds)
        )
        return self._retrying(lambda conn, _: int(conn.execute(stmt).rowcount or 0))

    def expired_leases(self, now: float | None = None, limit: int = 500) -> list[ToolCallRow]:
        """Running calls whose lease ran out by ``now`` (default: the store's clock): their
        worker is gone or stopped renewing."""
        bound = store_now() if now is None else literal(now)
        stmt = (
            select(CALLS)
            .where(CALLS.c.status == CallStatus.RUNNING.value, CALLS.c.lease_expires_at < bound)
            .limit(limit)
        )
        return self._retrying(lambda conn, _: readable_calls(conn.execute(stmt).mappings()),
                              read=True, single=True)

    def stranded_queued(self, published_before: float, limit: int = 500) -> list[ToolCallRow]:
        """Queued calls with no publish since ``published_before``: the never published first,
        then the oldest publishes; at most ``limit``.

        Two range reads of the ``(status, published_at)`` index, not one with ``OR``: with
        ``published_at < ? OR published_at IS NULL`` both engines walked every queued call
        when none was stranded (a backlog of 1M queued calls cost each idle sweep 80-220 ms).
        """
        queued = CALLS.c.status == CallStatus.QUEUED.value
        never = select(CALLS).where(queued, CALLS.c.published_at.is_(None)).limit(limit)
        stale = (select(CALLS).where(queued, CALLS.c.published_at < published_before)
                 .order_by(CALLS.c.published_at).limit(limit))

        def read(conn: Connection, _: int) -> list[ToolCallRow]:
            rows = readable_calls(conn.execute(never).mappings())
            if len(rows) < limit:
                # (PostgreSQL reads each statement at its own snapshot: a call is listed once)
                seen = {row.key for row in rows}
                rows += [row for row in readable_calls(conn.execute(
                    stale.limit(limit - len(rows))).mappings()) if row.key not in seen]
            return rows

        return self._retrying(read, read=True)
