"""A chaos run from start to verdict.

1. Start a private redis-server (AOF on, ``appendfsync everysec``), a store (SQLite in the
   run's directory, or a fresh PostgreSQL database), ``workers`` ``dex-tasks worker``
   processes (``workers.example_tools`` and ``chaos.tools``) and ``dex-tasks beat``. With
   ``mixed`` (the default) the workers are not alike: the first is prefork serving every tool,
   the second a threads-pool worker serving only the I/O-bound tools, the third a prefork
   worker serving another subset (:func:`worker_specs`), so calls must be routed to a worker
   that has their tool.
2. Drive the mixed load of ``chaos.load`` while ``chaos.faults`` kills processes and crashes
   Redis on a schedule.
3. Wait (bounded) until every call has ended, stop everything, and check the run with
   ``chaos.checks``: the store's calls and tool messages, the fsynced ledger of executions,
   and the kills.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url

from chaos.checks import Tally, ToolMessage, Verdict, check_run
from chaos.faults import AOF_MARKER, Faults
from chaos.load import ACTIVE, Driver, plan
from chaos.procs import Cluster, WorkerSpec, wait_for
from dex_tasks import CallStatus, DexSettings, MessageRole
from dex_tasks.store import CALLS, EVENTS, MESSAGES, Store
from dex_tasks.store.models import ToolCallRow
from workers import ledger

TOOLS = "workers.example_tools,chaos.tools"
# The tools of the load (chaos.load.MIX) that wait on I/O, and the ones that write money.
IO_TOOLS = "lookup_order,flaky_read,update_address"
PAYMENT_TOOLS = "charge_card,refund_payment,lookup_order"
THREADS = 8


def worker_specs(concurrency: int, mixed: bool) -> list[WorkerSpec]:
    """The workers of a run, taken in turn: all alike, or a mix of pools and tool sets."""
    every = WorkerSpec("prefork", concurrency)
    if not mixed:
        return [every]
    return [every, WorkerSpec("threads", THREADS, IO_TOOLS),
            WorkerSpec("prefork", concurrency, PAYMENT_TOOLS)]


@dataclass
class Config:
    """What a run does. Fault counts of ``None`` scale with ``duration``."""

    calls: int = 2000
    workers: int = 3
    concurrency: int = 2
    mixed: bool = True
    duration: float = 60.0
    child_kills: int | None = None
    worker_kills: int | None = None
    beat_restarts: int | None = None
    redis_restarts: int = 1
    redis_outage: float = 2.0
    store_faults: int = 1
    store_outage: float = 2.0
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
            "store": self.store_faults,
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


class Harness:
    """One chaos run. ``run()`` returns the :class:`Report`; everything it started is stopped."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix="dex-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ledger_path = self.workdir / "ledger.jsonl"
        self.cluster = Cluster(self.workdir, TOOLS,
                               worker_specs(config.concurrency, config.mixed))
        self.tally = Tally()
        self.stop = threading.Event()
        self.created_db: tuple[str, str] | None = None
        self.timings: dict[str, float] = {}

    def say(self, message: str) -> None:
        if self.config.progress is not None:
            self.config.progress(message)

    # -- set-up and tear-down -------------------------------------------------------------------

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
        # Short leases and windows, so that lost work is found within seconds.
        return DexSettings(
            redis_url=f"{self.cluster.redis.url}/0",
            database_url=self._database_url(),
            secret_key="chaos-harness-secret",  # type: ignore[arg-type]
            lease_seconds=self.config.lease_seconds,
            republish_after_seconds=self.config.republish_after_seconds,
            sweep_interval_seconds=1.0,
            visibility_timeout_seconds=30,
            retry_backoff_base_seconds=0.05,
            retry_backoff_max_seconds=0.5,
            publish_timeout_seconds=1.0,
            state_dir=self.workdir / "state",
        )

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEX_")}
        for name, value in self.settings.model_dump().items():
            if value is None:
                continue  # unset stays unset ("None" would be a value)
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"DEX_{name.upper()}"] = str(value)
        env[ledger.ENV] = str(self.ledger_path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _set_up(self) -> None:
        self.cluster.redis.start()
        self.settings = self._settings()
        self.cluster.env = self._env()
        self.store = Store(self.settings.database_url)
        self.store.create_all()
        client = redis.Redis.from_url(self.settings.redis_url)
        client.set(AOF_MARKER, "1")
        client.close()
        for _ in range(self.config.workers):
            self.cluster.start_worker()
        beat = self.cluster.start_beat()
        wait_for(lambda: all(w.ready() for w in self.cluster.workers), 90,
                 "the workers to be ready")
        wait_for(beat.ready, 60, "beat to start")
        self.driver = Driver(self.settings, self.tally, self.rng, self.stop)
        # A PostgreSQL server may apply a commit the frozen client sent just before SIGSTOP;
        # SQLite commits happen in the client process itself.
        pause = 0.005 if self.settings.database_url.startswith("sqlite") else 0.05
        self.faults = Faults(self.cluster, self.store, self.ledger_path, self.tally, self.rng,
                             redis_outage=self.config.redis_outage, freeze_pause=pause,
                             store_outage=self.config.store_outage)

    def _tear_down(self) -> None:
        self.stop.set()
        if hasattr(self, "driver"):
            self.driver.join_helpers()
        self.cluster.stop()

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> Report:
        """Run the whole thing; always stops what it started."""
        t0 = time.monotonic()
        # The library's own warnings (a publish that failed while Redis was down, ...) are
        # expected here: they go to the run's log, not the terminal.
        handler = logging.FileHandler(self.workdir / "harness.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logging.getLogger().addHandler(handler)
        try:
            self.say(f"starting redis, {self.config.workers} workers and beat in {self.workdir}")
            for i in range(self.config.workers):
                spec = self.cluster.specs[i % len(self.cluster.specs)]
                self.say(f"  worker {i + 1}: {spec.describe()}")
            self._set_up()
            self.timings["start"] = time.monotonic() - t0
            self._load()
            self._settle()
        finally:
            self._tear_down()
            self.timings["total"] = time.monotonic() - t0
            logging.getLogger().removeHandler(handler)
            handler.close()
        report = self._verdict()
        try:
            self.store.close()
            self._drop_database()
        finally:
            if not self.config.keep and report.ok:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return report

    def _load(self) -> None:
        # The slow calls outlive their first lease: renewal must keep them from being reaped.
        specs = plan(self.config.calls, self.rng, slow=self.config.lease_seconds * 1.5)
        events = self.faults.schedule(self.config.faults(), self.config.duration)
        cap = self.config.max_in_flight or self.config.workers * self.config.concurrency * 3
        started = time.monotonic()
        faults = threading.Thread(target=self.faults.inject,
                                  args=(events, started, self.stop, self.say),
                                  name="chaos-faults", daemon=True)
        self.driver.start_helpers()
        faults.start()
        self.driver.submit_all(specs, self.config.duration, self.config.drivers, cap)
        self.say(f"all {len(specs)} calls made in {time.monotonic() - started:.1f}s")
        faults.join()
        self.timings["load"] = time.monotonic() - started

    def _unfinished(self) -> list[tuple[str, str]]:
        with self.store.read() as conn:
            rows = conn.execute(
                select(CALLS.c.key, CALLS.c.status)
                .where(CALLS.c.status.in_([*ACTIVE, CallStatus.AWAITING_APPROVAL.value]))
            ).all()
        return [(str(k), str(s)) for k, s in rows]

    def _settle(self) -> None:
        """Wait until every call has ended (the approver and the system keep working)."""
        started = time.monotonic()
        deadline = started + self.config.settle_timeout
        last = -1
        while time.monotonic() < deadline:
            unfinished = self._unfinished()
            if not unfinished:
                break
            if len(unfinished) != last:
                self.say(f"waiting for {len(unfinished)} unfinished calls, e.g. {unfinished[:3]}")
                last = len(unfinished)
            time.sleep(0.25)
        self.timings["settle"] = time.monotonic() - started
        killed = {pid for kill in self.faults.kills for pid in kill.pids}
        for worker in self.cluster.workers:
            if worker.pid not in killed and not worker.alive:
                self.tally.problem(f"worker_exited: worker {worker.pid} exited on its own "
                                   f"(log {worker.log_path})")

    def _lost_attempts(self) -> list[tuple[str, int]]:
        """(key, attempt) of every attempt the system declared lost, from the event rows."""
        with self.store.read() as conn:
            rows = conn.execute(
                select(EVENTS.c.key, EVENTS.c.detail)
                # Filtered here, not with LIKE: on PostgreSQL the detail is jsonb.
                .where(EVENTS.c.from_status == CallStatus.RUNNING.value,
                       EVENTS.c.detail.is_not(None))
            ).all()
        lost = []
        for key, detail in rows:
            data = json.loads(detail)
            if isinstance(data, dict) and data.get("reason") == "attempt_lost":
                lost.append((str(key), int(data["attempt"])))
        return lost

    def _verdict(self) -> Report:
        with self.store.read() as conn:
            rows = conn.execute(select(CALLS)).mappings().all()
            tool_messages = [ToolMessage(str(key), str(status)) for key, status in conn.execute(
                select(MESSAGES.c.key, MESSAGES.c.call_status)
                .where(MESSAGES.c.role == MessageRole.TOOL.value))]
        calls = [ToolCallRow.model_validate(dict(r)) for r in rows]
        verdict = check_run(calls, ledger.read(self.ledger_path), self.faults.kills,
                            self.driver.intents, self._lost_attempts(), tool_messages)
        verdict.violations[:0] = self.tally.problems
        figures = Counter(verdict.figures)
        figures.update(self.tally.figures)
        missing = self.config.calls - len(calls) - figures["driver.call_tool_errors"]
        if missing:
            verdict.violations.append(f"calls_missing: {missing} planned calls are not stored")
        latencies = sorted(c.finished_at - c.created_at for c in calls
                           if c.finished_at is not None and c.tool == "lookup_order"
                           and c.status == CallStatus.SUCCEEDED.value)
        if latencies:
            figures["latency_ms.read_p50"] = int(1000 * latencies[len(latencies) // 2])
            figures["latency_ms.read_p99"] = int(1000 * latencies[int(len(latencies) * 0.99)])
        self.timings["redis_downtime"] = self.faults.redis_downtime
        return Report(self.config, verdict, figures, self.timings, self.workdir)


def run(config: Config) -> Report:
    """Run one chaos experiment with ``config``."""
    return Harness(config).run()
