"""The faults of a chaos run, on a schedule: SIGKILLed busy children, SIGKILLed whole workers
(with a replacement started at once), beat restarts, Redis crashes, and store faults (SQLite:
another process holds the write lock for a few seconds; PostgreSQL: the server drops every
connection of the database, again and again, for a few seconds).

A kill freezes its target first (SIGSTOP) and kills only once every call the target runs has
reached its tool, i.e. has its ledger line; otherwise it lets the target go on (SIGCONT) and
tries again a moment later. A process killed in the millisecond between the store's claim and
the tool's first ledger line would leave an ``outcome_unknown`` that no ledger line explains
(rightly so: nobody can know whether the tool began). The checks would have to take that on
trust, so the harness never causes it, and every ``outcome_unknown`` it sees must be explained
by a kill of the very process that ran the tool.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import select, text

from chaos.checks import Kill, Tally
from chaos.procs import Cluster, signal_quietly
from dex_tasks import CallStatus
from dex_tasks.broker.runs import Runs
from dex_tasks.store import CALLS, Store

AOF_MARKER = "dex:chaos:aof-marker"
# Where in the load phase each kind of fault may strike (fractions of its duration).
WINDOWS = {"child": (0.08, 0.9), "worker": (0.15, 0.85), "beat": (0.2, 0.8),
           "redis": (0.4, 0.6), "store": (0.25, 0.75)}

Running = tuple[str, int, int]  # (idempotency key, attempt, owner pid)


class LedgerTail:
    """Reads the ledger incrementally: which (key, attempt, pid) executions have started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.started: set[Running] = set()
        self.lock = threading.Lock()

    def refresh(self) -> set[Running]:
        """Read what was appended since the last call; returns every execution seen."""
        with self.lock:
            if self.path.exists():
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read()
                self.offset += len(data)
                lines = (self.partial + data).split(b"\n")
                self.partial = lines.pop()
                for raw in lines:
                    if raw.strip():
                        entry = json.loads(raw)
                        if entry.get("phase") in (None, "start"):
                            self.started.add((entry["key"], int(entry["attempt"]),
                                              int(entry["pid"])))
            return self.started


def owner_pid(worker: str | None) -> int | None:
    """The PID in a call's owner: ``<node>:<child pid>`` on prefork, ``<node>:<pid>:<thread>``
    on the threads pool (the worker's own process)."""
    parts = (worker or "").split(":")
    if len(parts) < 2:
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None


class Faults:
    """Injects the faults and records every kill for the checks."""

    def __init__(self, cluster: Cluster, store: Store, ledger_path: Path, tally: Tally,
                 rng: random.Random, *, redis_outage: float, freeze_pause: float,
                 store_outage: float = 2.0) -> None:
        self.cluster = cluster
        self.store = store
        self.ledger = LedgerTail(ledger_path)
        self.tally = tally
        self.rng = rng
        self.redis_outage = redis_outage
        self.freeze_pause = freeze_pause
        self.kills: list[Kill] = []
        self.redis_downtime = 0.0
        self.store_outage = store_outage

    def schedule(self, counts: dict[str, int], duration: float) -> list[tuple[float, str]]:
        """When each fault strikes (seconds into the load): spread over its window with some
        jitter, so that every fault meets calls in flight."""
        events = []
        for kind, count in counts.items():
            lo, hi = WINDOWS[kind]
            for i in range(count):
                at = duration * (lo + (hi - lo) * (i + self.rng.uniform(0.2, 0.8)) / count)
                events.append((at, kind))
        return sorted(events)

    def inject(self, events: list[tuple[float, str]], started: float, stop: threading.Event,
               say: Callable[[str], None]) -> None:
        """Run the schedule (in the calling thread) until done or ``stop`` is set."""
        actions: dict[str, Callable[[], Any]] = {
            "child": self.kill_busy_child,
            "worker": self.kill_worker,
            "beat": self.restart_beat,
            "redis": self.restart_redis,
            "store": self.disturb_store,
        }
        for at, kind in events:
            pause = started + at - time.monotonic()
            if pause > 0 and stop.wait(pause):
                return
            try:
                done = actions[kind]()
            except Exception as err:  # noqa: BLE001 - a fault that failed is reported
                self.tally.problem(f"fault_failed: {kind}: {type(err).__name__}: {err}")
                continue
            if done is not False:
                self.tally.count(f"faults.{kind}")
                say(f"fault: {kind} at {time.monotonic() - started:.1f}s")

    # -- who is inside a tool -------------------------------------------------------------------

    def _running(self) -> list[Running]:
        with self.store.read() as conn:
            rows = conn.execute(
                select(CALLS.c.key, CALLS.c.attempts, CALLS.c.worker)
                .where(CALLS.c.status == CallStatus.RUNNING.value)
            ).all()
        # Retrying calls run leased in Redis, queued in the store (DESIGN v4): their owners
        # are there. Redis down (a fault of its own): only the store's are seen this time.
        try:
            leased = Runs(redis.Redis.from_url(f"{self.cluster.redis.url}/0",
                                               socket_timeout=2)).running()
        except redis.RedisError:
            leased = {}
        owners: list[tuple[Any, Any, Any]] = [tuple(row) for row in rows]
        owners += [(key, run.attempt, run.worker) for key, run in leased.items()]
        result = []
        for key, attempts, worker in owners:
            pid = owner_pid(worker)
            if pid is not None:
                result.append((str(key), int(attempts), pid))
        return result

    def _owned(self, pids: set[int]) -> tuple[list[Running], bool]:
        """Running calls owned by ``pids``, and whether every one of them reached its tool."""
        started = self.ledger.refresh()
        owned = [r for r in self._running() if r[2] in pids]
        return owned, all(r in started for r in owned)

    # -- the faults -----------------------------------------------------------------------------

    def kill_busy_child(self) -> bool:
        """SIGKILL one worker child while it is inside a tool."""
        for _ in range(40):
            children = {kid for w in self.cluster.workers if w.alive for kid in w.children()}
            owned, _ = self._owned(children)
            busy = [r for r in owned if r in self.ledger.started]
            if not busy:
                time.sleep(0.05)
                continue
            key, attempt, pid = self.rng.choice(busy)
            if not signal_quietly(pid, signal.SIGSTOP):
                continue
            time.sleep(self.freeze_pause)
            owned, in_tool = self._owned({pid})
            if owned == [(key, attempt, pid)] and in_tool:
                signal_quietly(pid, signal.SIGKILL)
                self.kills.append(Kill(time.time(), "child", (pid,)))
                return True
            signal_quietly(pid, signal.SIGCONT)
        self.tally.count("faults.child_kill_skipped")
        return False

    def kill_worker(self) -> bool:
        """SIGKILL a whole worker (main process and children) and start a replacement."""
        live = [w for w in self.cluster.workers if w.serving]
        if not live:
            self.tally.count("faults.worker_kill_skipped")
            return False
        worker = self.rng.choice(live)
        for _ in range(60):
            # The main process first: once it is stopped it cannot fork a new child.
            signal_quietly(worker.pid, signal.SIGSTOP)
            kids = worker.children()
            for kid in kids:
                signal_quietly(kid, signal.SIGSTOP)
            time.sleep(self.freeze_pause)
            # A threads worker runs its calls in its own process, a prefork one in children.
            _, in_tool = self._owned({worker.pid, *kids})
            if in_tool:
                pids = worker.kill_all(kids)
                self.kills.append(Kill(time.time(), "worker", tuple(pids)))
                self.cluster.start_worker(worker.spec)
                return True
            for pid in [worker.pid, *kids]:
                signal_quietly(pid, signal.SIGCONT)
            time.sleep(0.02)
        self.tally.count("faults.worker_kill_skipped")
        return False

    def restart_beat(self) -> None:
        """SIGKILL beat and start a new one."""
        self.cluster.start_beat()

    def restart_redis(self) -> None:
        """Crash Redis (SIGKILL) and start it again on the same port and directory."""
        server = self.cluster.redis
        server.kill()
        down = time.monotonic()
        time.sleep(self.redis_outage)
        server.start()
        self.redis_downtime += time.monotonic() - down
        # The marker was written at set-up, long before the crash: without it the server did
        # not reload its append-only file, and the run would not test what it claims to.
        client = redis.Redis.from_url(f"{server.url}/0")
        try:
            if client.get(AOF_MARKER) is None:
                self.tally.problem("redis_aof_not_reloaded: the marker written before the "
                                   "crash is gone after the restart")
        finally:
            client.close()

    def disturb_store(self) -> None:
        """Make the store unusable for ``store_outage`` seconds, as it happens in production.

        SQLite: a connection of this process takes the write lock (``BEGIN IMMEDIATE``) and
        holds it, so every writer (claims, finishes, lease renewals, the reaper) waits, and the
        leases of live calls run out meanwhile. PostgreSQL: every other connection to the
        database is terminated by the server, again every 50 ms, so transactions in flight
        die, commits are lost or only their answers, and pooled connections go stale.
        """
        until = time.monotonic() + self.store_outage
        if self.store.is_sqlite:
            with self.store.engine.connect() as conn:
                # The store's engine begins with BEGIN IMMEDIATE: the write lock is ours now.
                with conn.begin():
                    remaining = until - time.monotonic()
                    if remaining > 0:
                        time.sleep(remaining)
            return
        with self.store.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            while time.monotonic() < until:
                conn.execute(text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
                time.sleep(0.05)
