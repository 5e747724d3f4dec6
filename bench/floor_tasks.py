"""The contract's floor: what DESIGN's work for a call costs on plain Celery, with nothing else.

A call here does what DESIGN version 4 asks of a dex-tasks call of a retrying class, on the
same tables and indexes (a store at head), through the thinnest clients there are: the DB-API
driver itself (psycopg with server-side prepared statements, or ``sqlite3``) and plain Redis
commands; no SQLAlchemy, no policy, no argument validation, no signature, no metrics, no
tracing:

1. the producer inserts the call's row and its ``tool_call_requested`` event (one durable
   commit), then sends a Celery message (late ack, no result backend);
2. the worker's child reads the call's row, takes the attempt's lease in Redis (one ``SET``
   with an expiry), runs the no-op, and ends the call in one durable commit: the row moved to
   ``succeeded`` with its ``tool_call_started`` and ``tool_call_finished`` events and its tool
   message in the transcript, the session's delivery check made as the store makes it (on
   PostgreSQL its lock and read, ``dex_call_ended_check``); then drops the lease and publishes
   the end on the call's channel in one round trip;
3. the waiter reads the row, and when it has not ended, waits for that publish (handed the
   status, as a dex-tasks waiter is handed the signed record).

A lean variant (``lean_call``; ``Floor.end(lean=True)``, ``Waiter.wait(read=False)``) prices a
narrower contract: the end's event alone, no tool message row, no read by the waiter.

``python -m bench floor`` runs it beside plain Celery and dex-tasks: what lies between Celery
and this is what the contract's store and Redis work costs, whoever writes it; what lies
between this and dex-tasks is dex-tasks' own code. Started as
``celery -A bench.floor_tasks worker -c 2`` with ``BENCH_FLOOR_BROKER`` (a Redis URL) and
``BENCH_FLOOR_DATABASE`` (the store's SQLAlchemy URL).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery
from sqlalchemy.engine import make_url

from dex_tasks.store.delivery import DELIVERY_LOCK_SPACE

QUEUE = "bench.floor"
TASK = "bench.floor_call"
LEAN_TASK = "bench.floor_call_lean"
CHANNEL_PREFIX = "bench:floor:ended:"
LEASE_PREFIX = "bench:floor:run:"
LEASE_MS = 60_000

_COLUMNS = ("key, session_id, turn_id, tool_call_id, tool, arguments, effect, "
            "requires_approval, max_attempts, time_limit, status, prev_status, result, error, "
            "attempts, interrupt_id, worker, lease_expires_at, published_at, republishes, "
            "expires_at, created_at, updated_at, finished_at, original_arguments, "
            "approval_rule, trace_context")
READ = f"SELECT {_COLUMNS} FROM dex_tool_calls WHERE key = ?"

_INSERT_CALL = ("INSERT INTO dex_tool_calls (key, session_id, turn_id, tool_call_id, tool, "
                "arguments, effect, requires_approval, max_attempts, status, attempts, "
                "republishes, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, '{}', 'read', false, 3, 'queued', 0, 0, ?, ?)")
_INSERT_EVENT = ("INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
                 "created_at) VALUES (?, ?, 'tool_call_requested', NULL, 'queued', ?)")
# PostgreSQL: the insert and its event in one statement, as the store sends it.
_INSERT_PG = ("WITH new_call AS (" + _INSERT_CALL.replace("?", "%s") +
              " RETURNING key, session_id, created_at) "
              "INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
              "created_at) SELECT session_id, key, 'tool_call_requested', NULL, 'queued', "
              "created_at FROM new_call")

_END_CALL = ("UPDATE dex_tool_calls SET status = 'succeeded', prev_status = status, "
             "result = 'null', attempts = attempts + 1, worker = ?, updated_at = ?, "
             "finished_at = ? WHERE key = ? AND status = 'queued'")
_END_EVENTS = ("INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
               "created_at) SELECT session_id, key, 'tool_call_started', 'queued', 'running', "
               "? FROM dex_tool_calls WHERE key = ? UNION ALL "
               "SELECT session_id, key, 'tool_call_finished', 'running', 'succeeded', ? "
               "FROM dex_tool_calls WHERE key = ?")
# SQLite: whether the session has user messages waiting for its turn to end, as the store's
# ending asks (its write transaction already excludes every other writer).
_END_QUEUED = ("SELECT EXISTS (SELECT 1 FROM dex_messages WHERE status = 'queued' AND "
               "session_id = (SELECT session_id FROM dex_tool_calls WHERE key = ?))")
_END_MESSAGE = ("INSERT INTO dex_messages (session_id, role, created_at, turn_id, tool_call_id, "
                "tool, key, call_status, tool_arguments, tool_output) "
                "SELECT session_id, 'tool', ?, turn_id, tool_call_id, tool, key, 'succeeded', "
                "arguments, 'null' FROM dex_tool_calls WHERE key = ?")
# PostgreSQL: the move, both events and the tool message in one statement, with the
# session's delivery check (the store's function: the session's lock, then its read).
_END_PG = ("WITH moved AS (" + _END_CALL.replace("?", "%s") +
           " RETURNING key, session_id, turn_id, tool_call_id, tool, arguments, "
           f"dex_call_ended_check({DELIVERY_LOCK_SPACE}, session_id) AS queued), "
           "events AS (INSERT INTO dex_call_events (session_id, key, event, from_status, "
           "to_status, created_at) SELECT session_id, key, 'tool_call_started', 'queued', "
           "'running', %s FROM moved UNION ALL SELECT session_id, key, 'tool_call_finished', "
           "'running', 'succeeded', %s FROM moved) "
           "INSERT INTO dex_messages (session_id, role, created_at, turn_id, tool_call_id, "
           "tool, key, call_status, tool_arguments, tool_output) SELECT session_id, 'tool', %s, "
           "turn_id, tool_call_id, tool, key, 'succeeded', arguments, 'null' FROM moved")

# The lean floor (a narrower contract, priced): the end's event alone, holding the attempt's
# start in its detail (no ``tool_call_started`` row), and no tool message (a transcript that
# reads it from the call's row); the delivery check stays.
_LEAN_EVENT = ("INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
               "detail, created_at) SELECT session_id, key, 'tool_call_finished', 'queued', "
               "'succeeded', ?, ? FROM dex_tool_calls WHERE key = ?")
_LEAN_PG = ("WITH moved AS (" + _END_CALL.replace("?", "%s") +
            " RETURNING key, session_id, "
            f"dex_call_ended_check({DELIVERY_LOCK_SPACE}, session_id) AS queued) "
            "INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
            "detail, created_at) SELECT session_id, key, 'tool_call_finished', 'queued', "
            "'succeeded', %s, %s FROM moved")


class Floor:
    """One process's connection to the store's database, and the floor's statements on it."""

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        self.sqlite = url.get_backend_name() == "sqlite"
        self._conn: Any
        if self.sqlite:
            # The store's own pragmas: WAL, synchronous=NORMAL, and its busy timeout.
            self._conn = sqlite3.connect(url.database or "", isolation_level=None,
                                         check_same_thread=False)
            self._conn.execute("PRAGMA busy_timeout=5000")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._read = READ
        else:
            import psycopg

            # Autocommit, each statement its own durable commit, prepared on first use.
            self._conn = psycopg.connect(
                url.set(drivername="postgresql").render_as_string(hide_password=False),
                autocommit=True, prepare_threshold=0)
            self._read = READ.replace("?", "%s")  # psycopg's placeholders, made once
        self._lock = threading.Lock()

    def _run(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """``sql`` (in this driver's placeholders) and its rows."""
        with self._lock:
            if self.sqlite:
                return list(self._conn.execute(sql, params).fetchall())
            cur = self._conn.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    def _transaction(self, steps: Sequence[tuple[str, Sequence[Any]]]) -> bool:
        """SQLite: ``steps`` in one write transaction, committed only if the first one
        changed a row (it is the guarded move)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                first, *rest = steps
                if self._conn.execute(*first).rowcount == 0:
                    self._conn.execute("ROLLBACK")
                    return False
                for sql, params in rest:
                    self._conn.execute(sql, params)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return True

    def insert(self, key: str, session_id: str, turn_id: str, tool_call_id: str,
               tool: str) -> None:
        """The call's row and its first event, in one durable commit."""
        now = time.time()
        call = (key, session_id, turn_id, tool_call_id, tool, now, now)
        if self.sqlite:
            self._transaction([(_INSERT_CALL, call), (_INSERT_EVENT, (session_id, key, now))])
        else:
            self._run(_INSERT_PG, call)

    def read(self, key: str) -> str | None:
        """The call's status as stored (the whole row is read, as dex-tasks reads it)."""
        rows = self._run(self._read, (key,))
        return str(rows[0][10]) if rows else None

    def end(self, key: str, worker: str, started_at: float, *, lean: bool = False) -> None:
        """The move to ``succeeded`` with both events and the tool message, in one commit;
        ``lean``: with the end's event alone (the start in its detail) and no tool message."""
        now = time.time()
        if lean:
            detail = f'{{"started_at": {started_at!r}}}'
            if self.sqlite:
                self._transaction([(_END_CALL, (worker, now, now, key)),
                                   (_LEAN_EVENT, (detail, now, key)),
                                   (_END_QUEUED, (key,))])
            else:
                self._run(_LEAN_PG, (worker, now, now, key, detail, now))
            return
        if self.sqlite:
            self._transaction([
                (_END_CALL, (worker, now, now, key)),
                (_END_EVENTS, (started_at, key, now, key)),
                (_END_MESSAGE, (now, key)),
                (_END_QUEUED, (key,)),
            ])
        else:
            self._run(_END_PG, (worker, now, now, key, started_at, now, now))

    def close(self) -> None:
        self._conn.close()


def create_app(broker: str) -> Celery:
    """The floor's Celery app: JSON, late acks and one message per child at a time, as
    dex-tasks' retrying path; no result backend (the store holds the outcome)."""
    celery = Celery("bench_floor", broker=broker, set_as_current=False)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        enable_utc=True,
    )
    celery.task(name=TASK, shared=False)(floor_call)
    celery.task(name=LEAN_TASK, shared=False)(lean_call)
    return celery


_worker: dict[str, Any] = {}


def _in_child() -> tuple[Floor, redis.Redis]:
    """This child's connection and Redis client, made after the fork."""
    if _worker.get("pid") != os.getpid():
        _worker.update(pid=os.getpid(),
                       floor=Floor(os.environ["BENCH_FLOOR_DATABASE"]),
                       redis=redis.Redis.from_url(os.environ["BENCH_FLOOR_BROKER"]),
                       name=f"floor-{os.getpid()}")
    return _worker["floor"], _worker["redis"]


def forget_child() -> None:
    """Close this process's connection and Redis client (``_in_child`` makes new ones from the
    environment on the next call): ``bench child`` runs the floor in process, store after
    store."""
    floor, client = _worker.pop("floor", None), _worker.pop("redis", None)
    _worker.clear()
    if floor is not None:
        floor.close()
    if client is not None:
        client.close()


def floor_call(key: str, lean: bool = False) -> None:
    """A worker's part of one call: read, lease, run the no-op, end, drop the lease and
    announce (``lean``: the narrower ending, :meth:`Floor.end`)."""
    floor, client = _in_child()
    # The attempt's start, taken where dex-tasks takes it: before the call's read.
    started_at = time.time()
    status = floor.read(key)
    if status != "queued":
        return  # ended already, or not stored: nothing to run
    client.set(LEASE_PREFIX + key, _worker["name"], px=LEASE_MS)
    floor.end(key, _worker["name"], started_at, lean=lean)
    pipe = client.pipeline(transaction=False)
    pipe.delete(LEASE_PREFIX + key)
    pipe.publish(CHANNEL_PREFIX + key, "succeeded")
    pipe.execute()


def lean_call(key: str) -> None:
    """The lean floor's worker part (:func:`floor_call` with the narrower ending)."""
    floor_call(key, lean=True)


class Waiter:
    """The producer's side: one pattern subscription on the floor's Redis, read by a thread,
    whose ended keys wake ``wait``."""

    def __init__(self, broker: str) -> None:
        self._client = redis.Redis.from_url(broker)
        self._ended: set[str] = set()
        self._cond = threading.Condition()
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(**{CHANNEL_PREFIX + "*": self._handle})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.5, daemon=True)
        # Only once the subscription is in place can no end be missed: wait for a probe.
        probe = f"probe-{os.getpid()}-{time.monotonic_ns()}"
        deadline = time.monotonic() + 10
        with self._cond:
            while probe not in self._ended:
                if time.monotonic() > deadline:
                    raise TimeoutError("the floor's subscription was not confirmed")
                self._client.publish(CHANNEL_PREFIX + probe, "probe")
                self._cond.wait(0.05)
            self._ended.discard(probe)

    def _handle(self, message: dict[str, Any]) -> None:
        channel = message["channel"]
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        with self._cond:
            self._ended.add(name[len(CHANNEL_PREFIX):])
            self._cond.notify_all()

    def wait(self, floor: Floor, key: str, timeout: float, *, read: bool = True) -> None:
        """Read the call; unless it has ended, wait for its announcement. ``read=False``
        (the lean floor): only the announcement, which this subscription, made before the
        call was sent, cannot miss while its connection lasts."""
        if read and floor.read(key) == "succeeded":
            with self._cond:
                self._ended.discard(key)
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"floor call {key} did not end within {timeout} s")
                self._cond.wait(left)
            self._ended.discard(key)

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self._client.close()


# What ``celery -A bench.floor_tasks worker`` loads.
app = create_app(os.environ.get("BENCH_FLOOR_BROKER", "redis://127.0.0.1:6379/3"))
