"""The chaos run: its own Redis (AOF on), a store, workers and beat; a mixed load; faults on a
schedule; then a bounded wait for every call to end and the checks of ``chaos.checks``.

Faults: SIGKILL of busy worker children, SIGKILL of whole workers (main process and children,
a machine that vanishes; a replacement starts at once), SIGKILL and restart of beat, and
SIGKILL and restart of Redis on the same port and directory (the AOF reloads).

A kill freezes its target first (SIGSTOP) and only kills once every call the target runs has
reached its tool, i.e. has its ledger line. A process killed in the millisecond between the
store's claim and the tool's first line would leave an ``outcome_unknown`` that no ledger line
explains; the checks count that as a violation, so the harness never causes it. (The system
handles it the same way: the call is ``outcome_unknown`` because nobody can know.)
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from chaos.checks import APPROVE, EXPIRE, Kill, Verdict, check_run
from chaos.procs import DexProcess, RedisProcess, signal_quietly, wait_for
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.models import ToolCallRow
from dex_tasks.store import CALLS, Store
from workers import ledger

log = logging.getLogger("chaos")

TOOLS = "workers.example_tools,chaos.tools"
AOF_MARKER = "dex:chaos:aof-marker"
ACTIVE = (CallStatus.QUEUED.value, CallStatus.RUNNING.value)

# Share of each kind of call in the load.
MIX: dict[str, float] = {
    "read": 0.28,
    "flaky_read": 0.15,
    "idempotent_write": 0.2,
    "charge": 0.2,
    "refund_approved": 0.11,
    "refund_expiring": 0.06,
}


@dataclass
class Config:
    """What a run does. Fault counts of ``None`` scale with ``duration``."""

    calls: int = 2000
    workers: int = 3
    concurrency: int = 2
    duration: float = 60.0
    child_kills: int | None = None
    worker_kills: int | None = None
    beat_restarts: int | None = None
    redis_restarts: int = 1
    redis_outage: float = 2.0
    database_url: str | None = None
    settle_timeout: float = 120.0
    lease_seconds: float = 4.0
    republish_after_seconds: float = 5.0
    drivers: int = 3
    max_in_flight: int | None = None
    seed: int | None = None
    workdir: Path | None = None
    keep: bool = False
    progress: Callable[[str], None] | None = None

    def faults(self) -> dict[str, int]:
        """How many of each fault the run injects."""
        return {
            "child": self.child_kills if self.child_kills is not None
            else max(2, int(self.duration / 3)),
            "worker": self.worker_kills if self.worker_kills is not None
            else max(1, int(self.duration / 20)),
            "beat": self.beat_restarts if self.beat_restarts is not None
            else max(1, int(self.duration / 30)),
            "redis": self.redis_restarts,
        }


@dataclass
class Report:
    """A run's verdict, with the figures and timings gathered along the way."""

    config: Config
    verdict: Verdict
    figures: Counter[str] = field(default_factory=Counter)
    timings: dict[str, float] = field(default_factory=dict)
    workdir: Path | None = None

    @property
    def ok(self) -> bool:
        return self.verdict.ok


@dataclass(frozen=True)
class CallSpec:
    """One call the driver will make."""

    index: int
    kind: str
    tool: str
    arguments: dict[str, Any]
    approval_deadline: float | None = None

    @property
    def ids(self) -> tuple[str, str, str]:
        return f"chaos-{self.index % 40}", f"t{self.index}", "c0"

    @property
    def key(self) -> str:
        return "/".join(self.ids)


def plan(calls: int, rng: random.Random) -> list[CallSpec]:
    """A shuffled mixed load of ``calls`` calls."""
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]
    specs = []
    for i in range(calls):
        kind = rng.choices(kinds, weights)[0]
        order = str(1001 + i % 2)
        if kind == "read":
            specs.append(CallSpec(i, kind, "lookup_order",
                                  {"order_id": order, "sleep": round(rng.uniform(0, 0.3), 3)}))
        elif kind == "flaky_read":
            specs.append(CallSpec(i, kind, "flaky_read",
                                  {"order_id": order, "fail_rate": 0.3,
                                   "sleep": round(rng.uniform(0, 0.1), 3)}))
        elif kind == "idempotent_write":
            specs.append(CallSpec(i, kind, "update_address",
                                  {"order_id": order, "address": f"{i} Main St",
                                   "sleep": round(rng.uniform(0, 0.3), 3)}))
        elif kind == "charge":
            specs.append(CallSpec(i, kind, "charge_card",
                                  {"customer_id": f"cu_{i}", "amount_cents": 100 + i,
                                   "sleep": round(rng.uniform(0, 0.4), 3)}))
        else:
            deadline = round(rng.uniform(1.0, 3.0), 2) if kind == "refund_expiring" else None
            specs.append(CallSpec(i, kind, "refund_payment",
                                  {"charge_id": f"ch_{i}", "amount_cents": 50 + i},
                                  approval_deadline=deadline))
    return specs


class LedgerTail:
    """Reads the ledger incrementally: which (key, attempt, pid) executions have started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.started: set[tuple[str, int, int]] = set()
        self.lock = threading.Lock()

    def refresh(self) -> set[tuple[str, int, int]]:
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


def _owner_pid(worker: str | None) -> int | None:
    if not worker or ":" not in worker:
        return None
    try:
        return int(worker.rsplit(":", 1)[1])
    except ValueError:
        return None


class Harness:
    """One chaos run. ``run()`` returns the :class:`Report`; everything it started is stopped."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix="dex-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ledger_path = self.workdir / "ledger.jsonl"
        self.ledger = LedgerTail(self.ledger_path)
        self.redis = RedisProcess(self.workdir / "redis")
        self.workers: list[DexProcess] = []
        self.beat: DexProcess | None = None
        self.kills: list[Kill] = []
        self.intents: dict[str, str] = {}
        self.figures: Counter[str] = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.in_flight = 0
        self.approvals: queue.PriorityQueue[tuple[float, int, str, str, str]] = (
            queue.PriorityQueue()
        )
        self.created_db: tuple[str, str] | None = None
        self.process_count = 0
        self.timings: dict[str, float] = {}

    # -- set-up and tear-down -------------------------------------------------------------------

    def count(self, figure: str, n: int = 1) -> None:
        with self.lock:
            self.figures[figure] += n

    def say(self, message: str) -> None:
        if self.config.progress is not None:
            self.config.progress(message)

    def _database_url(self) -> str:
        url = self.config.database_url
        if not url:
            return f"sqlite:///{self.workdir / 'dex.db'}"
        if not url.startswith("postgresql"):
            return url
        # A fresh database per run on the given server, dropped afterwards.
        name = f"dex_chaos_{uuid.uuid4().hex[:10]}"
        admin = create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        self.created_db = (url, name)
        return make_url(url).set(database=name).render_as_string(hide_password=False)

    def _drop_database(self) -> None:
        if self.created_db is None:
            return
        url, name = self.created_db
        admin = create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    def _settings(self) -> DexSettings:
        return DexSettings(
            redis_url=f"{self.redis.url}/0",
            database_url=self._database_url(),
            secret_key="chaos-harness-secret",  # type: ignore[arg-type]
            lease_seconds=self.config.lease_seconds,
            republish_after_seconds=self.config.republish_after_seconds,
            sweep_interval_seconds=1.0,
            visibility_timeout_seconds=30,
            retry_backoff_base_seconds=0.05,
            retry_backoff_max_seconds=0.5,
            publish_timeout_seconds=1.0,
        )

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
        for name, value in self.settings.model_dump().items():
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"DEX_{name.upper()}"] = str(value)
        env[ledger.ENV] = str(self.ledger_path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start_worker(self) -> DexProcess:
        self.process_count += 1
        worker = DexProcess(["worker", "--tools", TOOLS, "-c", str(self.config.concurrency),
                             "--loglevel", "INFO"],
                            self.env, self.workdir / f"worker-{self.process_count}.log")
        self.workers.append(worker)
        return worker

    def _start_beat(self) -> DexProcess:
        self.process_count += 1
        self.beat = DexProcess(["beat", "--loglevel", "INFO"], self.env,
                               self.workdir / f"beat-{self.process_count}.log")
        return self.beat

    def _set_up(self) -> None:
        self.redis.start()
        self.settings = self._settings()
        self.env = self._env()
        self.store = Store(self.settings.database_url)
        self.store.create_all()
        client = redis.Redis.from_url(self.settings.redis_url)
        client.set(AOF_MARKER, "1")
        client.close()
        for _ in range(self.config.workers):
            self._start_worker()
        beat = self._start_beat()
        wait_for(lambda: all(w.ready() for w in self.workers), 90, "the workers to be ready")
        wait_for(beat.ready, 60, "beat to start")

    def _tear_down(self) -> None:
        self.stop.set()
        for thread in getattr(self, "helpers", []):
            thread.join(10)
        for proc in [*self.workers, *([self.beat] if self.beat else [])]:
            proc.stop(timeout=10)
        self.redis.kill()

    # -- the load -------------------------------------------------------------------------------

    def _monitor(self) -> None:
        store = Store(self.settings.database_url)
        try:
            while not self.stop.wait(0.2):
                try:
                    with store.read() as conn:
                        self.in_flight = int(conn.execute(
                            select(func.count()).select_from(CALLS)
                            .where(CALLS.c.status.in_(ACTIVE))
                        ).scalar_one())
                except Exception:
                    log.warning("in-flight count failed", exc_info=True)
        finally:
            store.dispose()

    def _submit(self, specs: Iterator[CallSpec], started: float, spacing: float,
                cap: int) -> None:
        client = DexClient(self.settings, create_tables=False)
        try:
            while not self.stop.is_set():
                with self.lock:
                    spec = next(specs, None)
                if spec is None:
                    return
                pause = started + spec.index * spacing - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                while self.in_flight >= cap and not self.stop.is_set():
                    time.sleep(0.02)
                self._call(client, spec)
        finally:
            client.close()

    def _call(self, client: DexClient, spec: CallSpec) -> None:
        session, turn, call_id = spec.ids
        if spec.kind == "refund_expiring":
            self.intents[spec.key] = EXPIRE
        elif spec.kind == "refund_approved":
            self.intents[spec.key] = APPROVE
        try:
            record = client.call_tool(session_id=session, turn_id=turn, tool_call_id=call_id,
                                      tool=spec.tool, arguments=spec.arguments,
                                      approval_deadline=spec.approval_deadline)
        except Exception as err:  # noqa: BLE001 - reported as a violation
            with self.lock:
                self.figures["driver.call_tool_errors"] += 1
                self.problems.append(f"call_tool_raised: {spec.key}: {type(err).__name__}: {err}")
            return
        with self.lock:
            self.figures["driver.calls"] += 1
            if record.status is CallStatus.FAILED:
                self.figures["driver.failed_at_call"] += 1
        if spec.kind == "refund_approved" and record.interrupt_id:
            due = time.monotonic() + self.rng.uniform(0.2, 1.5)
            self.approvals.put((due, spec.index, session, record.interrupt_id, spec.key))

    def _approve(self) -> None:
        """The person at the approval page: approves each "approved" refund after a moment."""
        client = DexClient(self.settings, create_tables=False)
        try:
            while not self.stop.is_set():
                try:
                    due, index, session, interrupt_id, key = self.approvals.get(timeout=0.2)
                except queue.Empty:
                    continue
                wait = due - time.monotonic()
                if wait > 0:
                    self.approvals.put((due, index, session, interrupt_id, key))
                    time.sleep(min(wait, 0.05))
                    continue
                try:
                    decided = client.resolve_interrupt(session, interrupt_id, True,
                                                       approver="chaos-driver")
                except Exception:  # noqa: BLE001 - the store was busy: safe to retry
                    self.count("approvals.retried")
                    self.approvals.put((time.monotonic() + 0.5, index, session, interrupt_id,
                                        key))
                    continue
                if decided:
                    self.count("approvals.approved")
                elif client.get_tool_call(key).status is CallStatus.AWAITING_APPROVAL:
                    with self.lock:
                        self.problems.append(f"approval_refused: {key}: resolve_interrupt "
                                             "returned False for a pending call")
        finally:
            client.close()

    # -- faults ---------------------------------------------------------------------------------

    def _running(self) -> list[tuple[str, int, int]]:
        """(key, attempt, owner pid) of every running call."""
        with self.store.read() as conn:
            rows = conn.execute(
                select(CALLS.c.key, CALLS.c.attempts, CALLS.c.worker)
                .where(CALLS.c.status == CallStatus.RUNNING.value)
            ).all()
        result = []
        for key, attempts, worker in rows:
            pid = _owner_pid(worker)
            if pid is not None:
                result.append((str(key), int(attempts), pid))
        return result

    def _in_tool(self, pids: set[int]) -> tuple[list[tuple[str, int, int]], bool]:
        """Running calls owned by ``pids``, and whether every one of them reached its tool."""
        started = self.ledger.refresh()
        owned = [r for r in self._running() if r[2] in pids]
        return owned, all(r in started for r in owned)

    def _freeze_pause(self) -> None:
        # Let a commit the target sent just before SIGSTOP land (a PostgreSQL server may apply
        # it after the client stopped); SQLite commits are in-process and need no wait.
        time.sleep(0.05 if self.created_db or not self.settings.database_url.startswith(
            "sqlite") else 0.005)

    def kill_busy_child(self) -> bool:
        """SIGKILL one worker child that is inside a tool."""
        for _ in range(40):
            children = {kid for w in self.workers if w.alive for kid in w.children()}
            owned, _ = self._in_tool(children)
            busy = [r for r in owned if r in self.ledger.started]
            if not busy:
                time.sleep(0.05)
                continue
            key, attempt, pid = self.rng.choice(busy)
            if not signal_quietly(pid, signal.SIGSTOP):
                continue
            self._freeze_pause()
            owned, in_tool = self._in_tool({pid})
            if owned == [(key, attempt, pid)] and in_tool:
                signal_quietly(pid, signal.SIGKILL)
                self.kills.append(Kill(time.time(), "child", (pid,)))
                return True
            signal_quietly(pid, signal.SIGCONT)
        self.count("faults.child_kill_skipped")
        return False

    def kill_worker(self) -> bool:
        """SIGKILL a whole worker (main process and children) and start a replacement."""
        live = [w for w in self.workers if w.serving]
        if not live:
            self.count("faults.worker_kill_skipped")
            return False
        worker = self.rng.choice(live)
        for _ in range(60):
            signal_quietly(worker.pid, signal.SIGSTOP)
            kids = worker.children()
            for kid in kids:
                signal_quietly(kid, signal.SIGSTOP)
            self._freeze_pause()
            _, in_tool = self._in_tool(set(kids))
            if in_tool:
                pids = worker.kill_all(kids)
                self.kills.append(Kill(time.time(), "worker", tuple(pids)))
                self._start_worker()
                return True
            for pid in [worker.pid, *kids]:
                signal_quietly(pid, signal.SIGCONT)
            time.sleep(0.02)
        self.count("faults.worker_kill_skipped")
        return False

    def restart_beat(self) -> None:
        if self.beat is not None:
            self.beat.kill_all()
        self._start_beat()

    def restart_redis(self) -> None:
        """Crash Redis and start it again on the same port and directory."""
        self.redis.kill()
        down = time.monotonic()
        time.sleep(self.config.redis_outage)
        self.redis.start()
        self.timings["redis_downtime"] = self.timings.get("redis_downtime", 0.0) + (
            time.monotonic() - down)
        # The marker was written at set-up, long before the crash: without it the server did
        # not reload its append-only file, and the run would not test what it claims to.
        client = redis.Redis.from_url(self.settings.redis_url)
        try:
            if client.get(AOF_MARKER) is None:
                with self.lock:
                    self.problems.append("redis_aof_not_reloaded: the marker written before the "
                                         "crash is gone after the restart")
        finally:
            client.close()

    def _schedule(self) -> list[tuple[float, str]]:
        """When each fault strikes (seconds into the load): spread over the load phase with
        some jitter, Redis in its middle, so every fault meets calls in flight."""
        span = self.config.duration
        windows = {"child": (0.08, 0.9), "worker": (0.15, 0.85), "beat": (0.2, 0.8),
                   "redis": (0.4, 0.6)}
        events = []
        for kind, count in self.config.faults().items():
            lo, hi = windows[kind]
            for i in range(count):
                at = span * (lo + (hi - lo) * (i + self.rng.uniform(0.2, 0.8)) / count)
                events.append((at, kind))
        return sorted(events)

    def _inject(self, started: float) -> None:
        actions: dict[str, Callable[[], Any]] = {
            "child": self.kill_busy_child,
            "worker": self.kill_worker,
            "beat": self.restart_beat,
            "redis": self.restart_redis,
        }
        for at, kind in self._schedule():
            pause = started + at - time.monotonic()
            if pause > 0 and self.stop.wait(pause):
                return
            try:
                done = actions[kind]()
            except Exception as err:  # noqa: BLE001 - a fault that failed is reported
                with self.lock:
                    self.problems.append(f"fault_failed: {kind}: {type(err).__name__}: {err}")
                continue
            if done is not False:
                self.count(f"faults.{kind}")
                self.say(f"fault: {kind} at {time.monotonic() - started:.1f}s")

    # -- the run --------------------------------------------------------------------------------

    def _count_active(self) -> tuple[int, list[tuple[str, str]]]:
        with self.store.read() as conn:
            rows = conn.execute(
                select(CALLS.c.key, CALLS.c.status)
                .where(CALLS.c.status.in_([*ACTIVE, CallStatus.AWAITING_APPROVAL.value]))
            ).all()
        return len(rows), [(str(k), str(s)) for k, s in rows[:5]]

    def run(self) -> Report:
        """Run the whole thing; always stops what it started."""
        t0 = time.monotonic()
        specs = plan(self.config.calls, self.rng)
        # The library's own warnings (a publish that failed while Redis was down, ...) are
        # expected here: they go to the run's log, not the terminal.
        handler = logging.FileHandler(self.workdir / "harness.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.getLogger().addHandler(handler)
        try:
            self.say(f"starting redis, {self.config.workers} workers and beat in {self.workdir}")
            self._set_up()
            self.timings["start"] = time.monotonic() - t0
            self._drive(specs)
            self._settle()
        finally:
            self._tear_down()
            self.timings["total"] = time.monotonic() - t0
            logging.getLogger().removeHandler(handler)
            handler.close()
        report = self._verdict()
        try:
            self.store.dispose()
            self._drop_database()
        finally:
            if not self.config.keep and report.ok:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return report

    def _drive(self, specs: list[CallSpec]) -> None:
        cap = self.config.max_in_flight or self.config.workers * self.config.concurrency * 3
        spacing = self.config.duration / max(1, len(specs))
        started = time.monotonic()
        iterator = iter(specs)
        threads = [threading.Thread(target=self._monitor, name="chaos-monitor", daemon=True),
                   threading.Thread(target=self._approve, name="chaos-approver", daemon=True)]
        submitters = [threading.Thread(target=self._submit, args=(iterator, started, spacing, cap),
                                       name=f"chaos-driver-{i}", daemon=True)
                      for i in range(self.config.drivers)]
        faults = threading.Thread(target=self._inject, args=(started,), name="chaos-faults",
                                  daemon=True)
        for thread in [*threads, *submitters, faults]:
            thread.start()
        self.helpers = threads
        for thread in submitters:
            thread.join()
        self.say(f"all {len(specs)} calls submitted in {time.monotonic() - started:.1f}s")
        faults.join()
        self.timings["load"] = time.monotonic() - started

    def _settle(self) -> None:
        started = time.monotonic()
        deadline = started + self.config.settle_timeout
        last = -1
        while time.monotonic() < deadline:
            count, sample = self._count_active()
            if count == 0:
                break
            if count != last:
                self.say(f"waiting for {count} unfinished calls, e.g. {sample}")
                last = count
            time.sleep(0.25)
        self.timings["settle"] = time.monotonic() - started
        for worker in self.workers:
            killed = any(worker.pid in k.pids for k in self.kills)
            if not killed and not worker.alive:
                self.problems.append(f"worker_exited: worker {worker.pid} exited on its own "
                                     f"(log {worker.log_path})")

    def _verdict(self) -> Report:
        with self.store.read() as conn:
            rows = conn.execute(select(CALLS)).mappings().all()
        calls = [ToolCallRow.model_validate(dict(r)) for r in rows]
        verdict = check_run(calls, ledger.read(self.ledger_path), self.kills, self.intents)
        verdict.violations[:0] = self.problems
        missing = self.config.calls - len(calls) - self.figures["driver.call_tool_errors"]
        if missing:
            verdict.violations.append(f"calls_missing: {missing} planned calls are not stored")
        figures = Counter(verdict.figures)
        figures.update(self.figures)
        latencies = sorted(c.finished_at - c.created_at for c in calls
                           if c.finished_at is not None and c.tool == "lookup_order"
                           and c.status == CallStatus.SUCCEEDED.value)
        if latencies:
            figures["latency_ms.read_p50"] = int(1000 * latencies[len(latencies) // 2])
            figures["latency_ms.read_p99"] = int(1000 * latencies[int(len(latencies) * 0.99)])
        return Report(self.config, verdict, figures, self.timings, self.workdir)


def run(config: Config) -> Report:
    """Run one chaos experiment with ``config``."""
    return Harness(config).run()
