"""Throughput and latency: dex-tasks against plain Celery on the same Redis.

Three variants run in turn, round after round (raw, read, single, raw, read, single, ...), so
that drift in the machine's load falls on all of them alike:

* ``raw``: a no-op Celery task (``bench/raw_tasks.py``), prefork ``-c 2``, JSON, Redis result
  backend; ``apply_async`` N times, then ``.get()`` every result.
* ``read``: ``DexClient.call_tool`` of a no-op ``read`` tool N times, then ``wait`` on each
  (10 calls per session, as if many agents were calling).
* ``single``: the same with a no-op ``non_idempotent_write`` tool (``requires_approval=False``),
  the single-attempt path.

Workers are real subprocesses (``celery -A bench.raw_tasks worker -c 2`` and ``dex-tasks worker
--tools bench.noop_tools -c 2``), started once per store and reused by every round. Between
rounds the store's call and event tables are emptied and the raw result database flushed, so
no round works on a bigger table than the one before.

Figures per store and variant: calls/s end to end (N / time from the first send to the last
result; the median of the rounds), the ratio to ``raw`` of the same round (median of the
rounds), enqueue/s (N / time of the send loop), p50/p99 of the send call (``apply_async`` or
``call_tool``), and p50/p99 of enqueue-to-terminal: ``created_at`` -> ``finished_at`` from the
store for dex-tasks, the client's clock before ``apply_async`` -> the result's ``date_done``
(written by the worker) for Celery. That latency is taken twice: over the N calls sent at once
(so it includes the time a call waits behind the others), and over ``latency_calls`` calls
made one at a time after each variant's burst (the latency of a call with no queue).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery import Celery
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import delete, select, text

from bench import raw_tasks
from bench.infra import (
    READ_TOOL,
    SINGLE_ATTEMPT_TOOL,
    TOOLS_MODULE,
    BenchError,
    RedisServer,
    WorkerProcess,
    child_env,
    fresh_store,
    machine_info,
    median,
    percentile,
    save_results,
    wait_for_catalog,
)
from bench.targets import check, print_targets
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.ops.procutil import dex_command
from dex_tasks.store import CALLS, EVENTS

VARIANTS = ("raw", "read", "single")
DEX_TOOLS = {"read": READ_TOOL, "single": SINGLE_ATTEMPT_TOOL}
# Redis databases of the one private server: dex broker and claims, Celery broker, results.
DEX_DB, RAW_BROKER_DB, RAW_BACKEND_DB = 0, 1, 2
CONCURRENCY = 2
WAIT_TIMEOUT = 120.0
# Calls are spread over sessions like the turns of many agents, not piled into one session
# (ending a call takes a per-session lock to deliver that session's queued messages).
CALLS_PER_SESSION = 10


def session_for(prefix: str, i: int) -> str:
    """The session of the ``i``-th call of a run (``CALLS_PER_SESSION`` calls per session)."""
    return f"{prefix}-{i // CALLS_PER_SESSION}"


@dataclass
class RoundResult:
    """One variant's N calls in one round."""

    store: str
    variant: str
    round: int
    calls: int
    elapsed: float
    send_elapsed: float
    send_latency: list[float] = field(repr=False)
    to_terminal: list[float] = field(repr=False)
    failures: int
    unloaded: list[float] = field(repr=False, default_factory=list)

    @property
    def rate(self) -> float:
        return self.calls / self.elapsed

    def summary(self) -> dict[str, Any]:
        return {
            "store": self.store, "variant": self.variant, "round": self.round,
            "calls": self.calls, "elapsed_s": round(self.elapsed, 4),
            "calls_per_s": round(self.rate, 1),
            "enqueue_per_s": round(self.calls / self.send_elapsed, 1),
            "send_p50_ms": _ms(percentile(self.send_latency, 50)),
            "send_p99_ms": _ms(percentile(self.send_latency, 99)),
            "terminal_p50_ms": _ms(percentile(self.to_terminal, 50)),
            "terminal_p99_ms": _ms(percentile(self.to_terminal, 99)),
            "unloaded_p50_ms": _ms(percentile(self.unloaded, 50)),
            "unloaded_p99_ms": _ms(percentile(self.unloaded, 99)),
            "failures": self.failures,
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


Advance = Callable[[int], None]


# -- the variants -------------------------------------------------------------------------------


def run_raw(app: Celery, calls: int, advance: Advance) -> tuple[float, float, list[float],
                                                               list[float], int]:
    """N ``apply_async`` of the no-op task, then ``.get()`` of every result."""
    task = app.tasks[raw_tasks.NOOP]
    sent: list[tuple[Any, float]] = []
    latency: list[float] = []
    start = time.perf_counter()
    for _ in range(calls):
        wall = time.time()
        t0 = time.perf_counter()
        result = task.apply_async()
        latency.append(time.perf_counter() - t0)
        sent.append((result, wall))
        advance(1)
    send_elapsed = time.perf_counter() - start
    failures = 0
    to_terminal: list[float] = []
    for result, wall in sent:
        try:
            result.get(timeout=WAIT_TIMEOUT)
        except Exception:  # noqa: BLE001 - a failed task is counted, not fatal
            failures += 1
        done = result.date_done
        if done is not None:
            to_terminal.append(_utc_timestamp(done) - wall)
        advance(1)
    elapsed = time.perf_counter() - start
    for result, _ in sent:
        result.forget()
    return elapsed, send_elapsed, latency, to_terminal, failures


def run_dex(client: DexClient, tool: str, session_id: str, calls: int,
            advance: Advance) -> tuple[float, float, list[float], list[float], int]:
    """N ``call_tool`` of a no-op tool, then ``wait`` on each call."""
    keys: list[str] = []
    latency: list[float] = []
    start = time.perf_counter()
    for i in range(calls):
        t0 = time.perf_counter()
        record = client.call_tool(session_id=session_for(session_id, i), turn_id="t",
                                  tool_call_id=f"c{i}", tool=tool)
        latency.append(time.perf_counter() - t0)
        keys.append(record.key)
        advance(1)
    send_elapsed = time.perf_counter() - start
    failures = 0
    for key in keys:
        if client.wait(key, timeout=WAIT_TIMEOUT).status != CallStatus.SUCCEEDED:
            failures += 1
        advance(1)
    elapsed = time.perf_counter() - start
    with client.store.read() as conn:
        rows = conn.execute(
            select(CALLS.c.created_at, CALLS.c.finished_at).where(
                CALLS.c.session_id.like(f"{session_id}-%"))
        ).all()
    to_terminal = [r.finished_at - r.created_at for r in rows if r.finished_at is not None]
    return elapsed, send_elapsed, latency, to_terminal, failures


def _utc_timestamp(done: datetime) -> float:
    # Celery writes an aware UTC date_done; a naive one (older backends) is UTC as well.
    return (done if done.tzinfo else done.replace(tzinfo=UTC)).timestamp()


def unloaded_raw(app: Celery, calls: int) -> list[float]:
    """Enqueue-to-terminal with one task in flight at a time (no queue in front of it)."""
    task = app.tasks[raw_tasks.NOOP]
    out: list[float] = []
    for _ in range(calls):
        wall = time.time()
        result = task.apply_async()
        result.get(timeout=WAIT_TIMEOUT)
        if result.date_done is not None:
            out.append(_utc_timestamp(result.date_done) - wall)
        result.forget()
    return out


def unloaded_dex(client: DexClient, tool: str, session_id: str, calls: int) -> list[float]:
    """Enqueue-to-terminal (from the store) with one call in flight at a time."""
    out: list[float] = []
    for i in range(calls):
        record = client.call_tool(session_id=session_for(session_id, i), turn_id="u",
                                  tool_call_id=f"c{i}", tool=tool)
        done = client.wait(record.key, timeout=WAIT_TIMEOUT)
        if done.finished_at is not None:
            out.append(done.finished_at.timestamp() - done.created_at.timestamp())
    return out


# -- one store ----------------------------------------------------------------------------------


@dataclass
class Bench:
    """The servers and workers of one store's runs."""

    redis_server: RedisServer
    database_url: str
    workdir: Path
    loglevel: str
    workers: list[WorkerProcess] = field(default_factory=list)
    client: DexClient | None = None
    raw_app: Celery | None = None

    def start(self) -> Bench:
        dex_env = child_env({"DEX_REDIS_URL": self.redis_server.url(DEX_DB),
                             "DEX_DATABASE_URL": self.database_url})
        raw_env = child_env({"BENCH_RAW_BROKER": self.redis_server.url(RAW_BROKER_DB),
                             "BENCH_RAW_BACKEND": self.redis_server.url(RAW_BACKEND_DB)})
        tag = uuid.uuid4().hex[:6]
        self.workers.append(WorkerProcess.start(
            "dex-tasks", [*dex_command(), "worker", "--tools", TOOLS_MODULE,
                          "-c", str(CONCURRENCY), "--loglevel", self.loglevel],
            dex_env, self.workdir / f"dex-worker-{tag}.log"))
        self.workers.append(WorkerProcess.start(
            "celery", [*celery_command(), "-A", "bench.raw_tasks", "worker",
                       "-c", str(CONCURRENCY), "-P", "prefork", "-Q", raw_tasks.QUEUE,
                       "-n", f"bench-raw-{tag}@%h", "--without-gossip", "--without-mingle",
                       "--loglevel", self.loglevel],
            raw_env, self.workdir / f"raw-worker-{tag}.log"))
        self.raw_app = raw_tasks.create_app(self.redis_server.url(RAW_BROKER_DB),
                                            self.redis_server.url(RAW_BACKEND_DB))
        settings = DexSettings(redis_url=self.redis_server.url(DEX_DB),
                               database_url=self.database_url)
        # The worker creates the tables and publishes the catalog; the client waits for that,
        # so two processes never race to create the same tables.
        self.client = DexClient(settings, create_tables=False)
        wait_for_catalog(self.client, SINGLE_ATTEMPT_TOOL, self.check_alive)
        for worker in self.workers:
            worker.wait_children(CONCURRENCY)
        return self

    def check_alive(self) -> None:
        for worker in self.workers:
            worker.check_alive()

    def run(self, variant: str, calls: int, session_id: str,
            advance: Advance) -> tuple[float, float, list[float], list[float], int]:
        self.check_alive()
        try:
            if variant == "raw":
                assert self.raw_app is not None
                return run_raw(self.raw_app, calls, advance)
            assert self.client is not None
            return run_dex(self.client, DEX_TOOLS[variant], session_id, calls, advance)
        except TimeoutError as err:
            self.check_alive()
            raise BenchError(f"{variant}: {err}") from err

    def run_unloaded(self, variant: str, calls: int, session_id: str) -> list[float]:
        self.check_alive()
        try:
            if variant == "raw":
                assert self.raw_app is not None
                return unloaded_raw(self.raw_app, calls)
            assert self.client is not None
            return unloaded_dex(self.client, DEX_TOOLS[variant], session_id, calls)
        except TimeoutError as err:
            self.check_alive()
            raise BenchError(f"{variant}: {err}") from err

    def purge(self) -> None:
        """Empty the call tables and the result database between rounds."""
        assert self.client is not None and self.raw_app is not None
        store = self.client.store
        with store.write() as conn:
            if store.is_sqlite:
                conn.execute(delete(EVENTS))
                conn.execute(delete(CALLS))
            else:
                conn.execute(text(f"TRUNCATE {EVENTS.name}, {CALLS.name}"))
        self.raw_app.control.purge()
        results = self.redis_server.client(RAW_BACKEND_DB)
        results.flushdb()
        claims = self.redis_server.client(DEX_DB)
        for key in claims.scan_iter("dex:claim:*", count=1000):
            claims.delete(key)
        results.close()
        claims.close()

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.raw_app is not None:
            self.raw_app.close()
        for worker in self.workers:
            worker.stop()


def celery_command() -> list[str]:
    """The command that starts Celery's own CLI in this Python (the plain-Celery workers)."""
    return [sys.executable, "-m", "celery"]


# -- the whole run ------------------------------------------------------------------------------


def run_throughput(
    *,
    calls: int,
    rounds: int,
    stores: list[str],
    postgres_url: str | None,
    warmup: int = 50,
    latency_calls: int = 100,
    loglevel: str = "WARNING",
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run every round on every store; print the tables; write and return the results."""
    if calls < 1 or rounds < 1 or latency_calls < 1:
        raise BenchError(f"--calls, --rounds and --latency-calls must be at least 1, got "
                         f"{calls}, {rounds} and {latency_calls}")
    console = console or Console()
    redis_server = RedisServer().start()
    machine = machine_info(redis_server, postgres_url if "postgres" in stores else None)
    results: list[RoundResult] = []
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-"))
    total = len(stores) * rounds * len(VARIANTS) * (calls * 2 + latency_calls)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("starting", total=total)
            for kind in stores:
                with fresh_store(kind, postgres_url, workdir) as database_url:
                    progress.update(bar, description=f"{kind}: starting workers")
                    bench = Bench(redis_server, database_url, workdir, loglevel)
                    try:
                        bench.start()
                        progress.update(bar, description=f"{kind}: warm-up")
                        for variant in VARIANTS:
                            bench.run(variant, warmup, f"warmup-{variant}", lambda _: None)
                        bench.purge()
                        for rnd in range(rounds):
                            for variant in VARIANTS:
                                progress.update(
                                    bar, description=f"{kind} round {rnd + 1}/{rounds}: {variant}")
                                session = f"bench-{variant}-{rnd}"
                                elapsed, send, latency, terminal, failures = bench.run(
                                    variant, calls, session,
                                    lambda n: progress.advance(bar, n))
                                unloaded = bench.run_unloaded(variant, latency_calls,
                                                              f"lat-{variant}-{rnd}")
                                progress.advance(bar, latency_calls)
                                results.append(RoundResult(kind, variant, rnd, calls, elapsed,
                                                           send, latency, terminal, failures,
                                                           unloaded))
                            bench.purge()
                    finally:
                        bench.stop()
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        machine["loadavg_after"] = list(os.getloadavg())

    rows = aggregate(results)
    targets = throughput_targets(rows)
    print_table(console, rows, calls, rounds)
    print_targets(console, targets)
    payload = {
        "config": {"calls": calls, "rounds": rounds, "stores": stores, "warmup": warmup,
                   "latency_calls": latency_calls,
                   "worker_concurrency": CONCURRENCY, "worker_loglevel": loglevel,
                   "raw": "Celery defaults + JSON, Redis result backend, results awaited",
                   "dex_client": "catalog lookup (tool code not imported by the agent side)"},
        "machine": machine,
        "summary": rows,
        "rounds": [r.summary() for r in results],
        "targets": targets,
    }
    return save_results("throughput", payload, out_dir, console)


def aggregate(results: list[RoundResult]) -> list[dict[str, Any]]:
    """Per store and variant: medians over rounds, ratios per round, pooled percentiles."""
    rows: list[dict[str, Any]] = []
    by = {(r.store, r.variant, r.round): r for r in results}
    for store in dict.fromkeys(r.store for r in results):
        for variant in VARIANTS:
            runs = [r for r in results if r.store == store and r.variant == variant]
            if not runs:
                continue
            vs_raw = [r.rate / by[(store, "raw", r.round)].rate for r in runs]
            row: dict[str, Any] = {
                "store": store,
                "variant": variant,
                "calls_per_s": round(median([r.rate for r in runs]), 1),
                "calls_per_s_rounds": [round(r.rate, 1) for r in runs],
                "vs_raw": round(median(vs_raw), 3),
                "enqueue_per_s": round(median([r.calls / r.send_elapsed for r in runs]), 1),
                "send_p50_ms": _ms(percentile(_pool(runs, "send_latency"), 50)),
                "send_p99_ms": _ms(percentile(_pool(runs, "send_latency"), 99)),
                "terminal_p50_ms": _ms(percentile(_pool(runs, "to_terminal"), 50)),
                "terminal_p99_ms": _ms(percentile(_pool(runs, "to_terminal"), 99)),
                "unloaded_p50_ms": _ms(percentile(_pool(runs, "unloaded"), 50)),
                "unloaded_p99_ms": _ms(percentile(_pool(runs, "unloaded"), 99)),
                "failures": sum(r.failures for r in runs),
            }
            if variant == "single":
                row["vs_read"] = round(median(
                    [r.rate / by[(store, "read", r.round)].rate for r in runs]), 3)
            rows.append(row)
    return rows


def _pool(runs: list[RoundResult], attr: str) -> list[float]:
    return [v for r in runs for v in getattr(r, attr)]


def throughput_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for store in dict.fromkeys(r["store"] for r in rows):
        by = {r["variant"]: r for r in rows if r["store"] == store}
        if "read" in by:
            out.append(check(f"read_vs_raw_{store}", by["read"]["vs_raw"], store))
        if "single" in by:
            out.append(check("single_vs_read", by["single"]["vs_read"], store))
        if "read" in by and "raw" in by:
            dex, raw = by["read"]["send_p50_ms"], by["raw"]["send_p50_ms"]
            out.append(check("call_tool_vs_apply_async_p50", dex / raw, store,
                             f"{dex:.2f} vs {raw:.2f} ms, sent back to back while the "
                             f"workers run"))
    return out


def print_table(console: Console, rows: list[dict[str, Any]], calls: int, rounds: int) -> None:
    table = Table(title=f"Throughput: {calls} no-op calls x {rounds} rounds per variant",
                  caption="calls/s, vs raw, enqueue/s: medians of the rounds. Latencies in ms "
                          "over all rounds. send: apply_async or call_tool. e2e: enqueue to "
                          "terminal of the N calls sent at once (includes queueing); 1-by-1: "
                          "the same with one call in flight")
    for column in ("store", "variant", "calls/s", "vs raw", "enqueue/s", "send p50",
                   "send p99", "e2e p50", "e2e p99", "1-by-1 e2e p50", "1-by-1 e2e p99",
                   "failed"):
        table.add_column(column, justify="left" if column in ("store", "variant") else "right")
    for r in rows:
        table.add_row(r["store"], r["variant"], f"{r['calls_per_s']:.0f}", f"{r['vs_raw']:.2f}x",
                      f"{r['enqueue_per_s']:.0f}", f"{r['send_p50_ms']:.2f}",
                      f"{r['send_p99_ms']:.2f}", f"{r['terminal_p50_ms']:.1f}",
                      f"{r['terminal_p99_ms']:.1f}", f"{r['unloaded_p50_ms']:.1f}",
                      f"{r['unloaded_p99_ms']:.1f}", str(r["failures"]))
    console.print(table)
