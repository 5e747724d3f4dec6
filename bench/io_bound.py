"""Many I/O-bound calls in flight: N calls of a tool that sleeps (1 s by default) on a threads
pool, ``dex-tasks worker --pool threads -c 200`` against ``celery worker --pool threads -c 200``
on the same Redis.

Agents' tools mostly wait on the network; a prefork worker runs only ``-c`` of them at once. Both
workers here run 200 threads in one process. Per round, each variant in turn (the first one
alternating between rounds): the client sends the N calls (``apply_async`` / ``call_tool``), then
waits for every result (``.get()`` / ``wait``). Figures: wall time from the first send to the
last result in hand, and the worker's resident memory (main process plus children, peak of
samples taken every 0.2 s while the round runs).

``dex-tasks worker --pool`` arrives with the threads pool (issue 12, item 2). Until the
installed ``dex-tasks worker --help`` lists it, the dex-tasks variant is skipped with a message
and only Celery's figures are printed.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import delete, text

from bench import raw_tasks
from bench.infra import (
    IO_TOOL,
    IO_TOOLS_MODULE,
    BenchError,
    RedisServer,
    WorkerProcess,
    bench_session,
    by_variant,
    child_env,
    fresh_store,
    median,
    save_results,
    wait_for_catalog,
)
from bench.targets import check, print_targets
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.ops.procutil import dex_command
from dex_tasks.store import CALLS, EVENTS, MESSAGES

VARIANTS = ("raw", "dex", "burst")
# The burst variant sends its calls with call_tools, this many per turn (one session each).
BURST_PER_TURN = 100
DEX_DB, RAW_BROKER_DB, RAW_BACKEND_DB = 3, 4, 5
MB = 1024 * 1024
CALLS_PER_SESSION = 10
SAMPLE_EVERY = 0.2


def threads_pool_supported() -> bool:
    """Whether the installed ``dex-tasks worker`` takes ``--pool`` (with ``threads``)."""
    done = subprocess.run([*dex_command(), "worker", "--help"], capture_output=True, text=True,
                          timeout=120, env=child_env({}))
    return "--pool" in done.stdout and "threads" in done.stdout


@dataclass
class IoRound:
    """One variant's N calls in one round."""

    store: str
    variant: str
    round: int
    calls: int
    wall: float
    send: float
    peak_rss: int
    failures: int
    samples: list[int] = field(repr=False, default_factory=list)


class RssSampler:
    """Samples a worker's RSS in a thread while a round runs; keeps the peak."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.worker.rss_bytes()[0])
            self._stop.wait(SAMPLE_EVERY)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.samples.append(self.worker.rss_bytes()[0])


@dataclass
class IoBench:
    """The two threads-pool workers of one store, and the clients that drive them."""

    redis_server: RedisServer
    database_url: str
    workdir: Path
    concurrency: int
    with_dex: bool
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    client: DexClient | None = None
    raw_app: Any = None

    def start(self) -> IoBench:
        tag = uuid.uuid4().hex[:6]
        raw_env = child_env({"BENCH_RAW_BROKER": self.redis_server.url(RAW_BROKER_DB),
                             "BENCH_RAW_BACKEND": self.redis_server.url(RAW_BACKEND_DB)})
        self.workers["raw"] = WorkerProcess.start(
            "celery threads", [sys.executable, "-m", "celery", "-A", "bench.raw_tasks", "worker",
                               "--pool", "threads", "-c", str(self.concurrency),
                               "-Q", raw_tasks.QUEUE, "-n", f"bench-io-raw-{tag}@%h",
                               "--without-gossip", "--without-mingle", "--loglevel", "WARNING"],
            raw_env, self.workdir / f"io-raw-{tag}.log")
        self.raw_app = raw_tasks.create_app(self.redis_server.url(RAW_BROKER_DB),
                                            self.redis_server.url(RAW_BACKEND_DB))
        if self.with_dex:
            dex_env = child_env({"DEX_REDIS_URL": self.redis_server.url(DEX_DB),
                                 "DEX_DATABASE_URL": self.database_url})
            self.workers["dex"] = WorkerProcess.start(
                "dex-tasks threads", [*dex_command(), "worker", "--tools", IO_TOOLS_MODULE,
                                      "--pool", "threads", "-c", str(self.concurrency),
                                      "--loglevel", "WARNING"],
                dex_env, self.workdir / f"io-dex-{tag}.log")
            self.client = DexClient(DexSettings(redis_url=self.redis_server.url(DEX_DB),
                                                database_url=self.database_url),
                                    create_tables=False)
            wait_for_catalog(self.client, IO_TOOL, self.check_alive)
        # Both answer a first call before any round is timed.
        self.run("raw", 4, 0.0, "warm")
        if self.with_dex:
            self.run("dex", 4, 0.0, "warm")
        return self

    def check_alive(self) -> None:
        for worker in self.workers.values():
            worker.check_alive()

    def run(self, variant: str, calls: int, seconds: float, session: str
            ) -> tuple[float, float, int]:
        """Send ``calls`` calls, then wait for each: (wall, send, failures)."""
        self.check_alive()
        try:
            if variant == "raw":
                return self._run_raw(calls, seconds)
            return self._run_dex(calls, seconds, session, burst=variant == "burst")
        except TimeoutError as err:
            self.check_alive()
            raise BenchError(f"{variant}: {err}") from err

    def _run_raw(self, calls: int, seconds: float) -> tuple[float, float, int]:
        task = self.raw_app.tasks[raw_tasks.SLEEP]
        start = time.perf_counter()
        results = [task.apply_async(args=[seconds]) for _ in range(calls)]
        sent = time.perf_counter() - start
        failures = 0
        for result in results:
            try:
                result.get(timeout=max(120.0, calls * seconds))
            except TimeoutError:
                raise
            except Exception:  # noqa: BLE001 - counted, not fatal
                failures += 1
        wall = time.perf_counter() - start
        for result in results:
            result.forget()
        return wall, sent, failures

    def _run_dex(self, calls: int, seconds: float, session: str, *, burst: bool = False,
                 ) -> tuple[float, float, int]:
        assert self.client is not None
        client = self.client
        start = time.perf_counter()
        if burst:
            keys = [record.key for first in range(0, calls, BURST_PER_TURN)
                    for record in client.call_tools(
                        [{"tool": IO_TOOL, "tool_call_id": f"c{i}",
                          "arguments": {"seconds": seconds}}
                         for i in range(first, min(calls, first + BURST_PER_TURN))],
                        session_id=f"{session}-{first}", turn_id="t")]
        else:
            keys = [client.call_tool(session_id=f"{session}-{i // CALLS_PER_SESSION}",
                                     turn_id="t", tool_call_id=f"c{i}", tool=IO_TOOL,
                                     arguments={"seconds": seconds}).key
                    for i in range(calls)]
        sent = time.perf_counter() - start
        failures = sum(client.wait(k, timeout=max(120.0, calls * seconds)).status
                       is not CallStatus.SUCCEEDED for k in keys)
        return time.perf_counter() - start, sent, failures

    def purge(self) -> None:
        if self.client is not None:
            store = self.client.store
            with store.write() as conn:
                if store.is_sqlite:
                    for table in (EVENTS, MESSAGES, CALLS):
                        conn.execute(delete(table))
                else:
                    conn.execute(text(f"TRUNCATE {EVENTS.name}, {MESSAGES.name}, {CALLS.name}"))
        results = self.redis_server.client(RAW_BACKEND_DB)
        results.flushdb()
        results.close()

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.raw_app is not None:
            self.raw_app.close()
        for worker in self.workers.values():
            worker.stop()


def run_io(
    *,
    calls: int,
    seconds: float,
    concurrency: int,
    rounds: int,
    stores: list[str],
    postgres_url: str | None,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the rounds on every store; print the table; write the results."""
    if calls < 1 or rounds < 1 or concurrency < 1 or seconds < 0:
        raise BenchError("--calls, --rounds and --concurrency must be at least 1, --seconds "
                         f"not negative; got {calls}, {rounds}, {concurrency}, {seconds}")
    console = console or Console()
    with_dex = threads_pool_supported()
    skipped = None
    if not with_dex:
        skipped = ("dex-tasks worker has no --pool threads yet (it comes with issue 12 item 2, "
                   "the routing branch): the dex-tasks variant is skipped; Celery's figures "
                   "only")
        console.print(f"[yellow]{skipped}[/yellow]")
    results: list[IoRound] = []
    idle: dict[tuple[str, str], int] = {}
    variants = VARIANTS if with_dex else ("raw",)
    worker_of = {"raw": "raw", "dex": "dex", "burst": "dex"}
    with bench_session("io", stores, postgres_url) as (redis_server, machine, workdir):
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url:
                bench = IoBench(redis_server, url, workdir, concurrency, with_dex)
                try:
                    with console.status(f"I/O on {kind}: starting the threads-pool workers"):
                        bench.start()
                    for name, worker in bench.workers.items():
                        idle[(kind, name)] = worker.rss_bytes()[0]
                    for rnd in range(rounds):
                        order = variants if rnd % 2 == 0 else variants[::-1]
                        for variant in order:
                            with console.status(f"I/O on {kind}, round {rnd + 1}/{rounds}: "
                                                f"{variant}, {calls} x {seconds:g}s calls"), \
                                    RssSampler(bench.workers[worker_of[variant]]) as sampler:
                                wall, send, failures = bench.run(variant, calls, seconds,
                                                                 f"io{rnd}-{variant}")
                            results.append(IoRound(kind, variant, rnd, calls, wall, send,
                                                   max(sampler.samples), failures,
                                                   sampler.samples))
                        bench.purge()
                finally:
                    bench.stop()
    rows = aggregate(results, idle)
    targets = io_targets(rows, skipped)
    print_table(console, rows, calls, seconds, concurrency, rounds)
    print_targets(console, targets)
    payload = {
        "config": {"calls": calls, "seconds": seconds, "concurrency": concurrency,
                   "rounds": rounds, "stores": stores, "pool": "threads",
                   "skipped": skipped},
        "machine": machine,
        "summary": rows,
        "rounds": [{"store": r.store, "variant": r.variant, "round": r.round,
                    "wall_s": round(r.wall, 3), "send_s": round(r.send, 3),
                    "peak_rss_mb": round(r.peak_rss / MB, 1), "failures": r.failures}
                   for r in results],
        "targets": targets,
    }
    return save_results("io", payload, out_dir, console)


def aggregate(results: list[IoRound], idle: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for store, variant, runs, raw_runs in by_variant(results, VARIANTS, "raw"):
        rows.append({
            "store": store, "variant": variant,
            "wall_s": round(median([r.wall for r in runs]), 3),
            "wall_rounds_s": [round(r.wall, 3) for r in runs],
            "send_s": round(median([r.send for r in runs]), 3),
            "after_send_s": round(median([r.wall - r.send for r in runs]), 3),
            "vs_raw": round(median([r.wall / b.wall for r, b in
                                    zip(runs, raw_runs, strict=True)]), 3),
            "idle_rss_mb": round(idle.get((store, "raw" if variant == "raw" else "dex"), 0)
                                 / MB, 1),
            "peak_rss_mb": round(max(r.peak_rss for r in runs) / MB, 1),
            "failures": sum(r.failures for r in runs),
        })
    return rows


def io_targets(rows: list[dict[str, Any]], skipped: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if skipped:
        return [check("io_wall_vs_raw", float("nan"), "dex-tasks --pool threads",
                      "skipped: no --pool threads yet")]
    raw = {r["store"]: r for r in rows if r["variant"] == "raw"}
    for r in rows:
        if r["variant"] == "raw":
            continue
        base = raw[r["store"]]
        how = ("call_tool one by one" if r["variant"] == "dex"
               else f"call_tools, {BURST_PER_TURN} per turn")
        out.append(check("io_wall_vs_raw", r["vs_raw"], f"{r['store']}, {how}",
                         f"{r['wall_s']:.1f} vs {base['wall_s']:.1f} s; sent in "
                         f"{r['send_s']:.2f} vs {base['send_s']:.2f} s"))
        if r["variant"] == "dex":
            out.append(check("io_rss", r["peak_rss_mb"], r["store"],
                             f"Celery's: {base['peak_rss_mb']:.0f} MB"))
    return out


def print_table(console: Console, rows: list[dict[str, Any]], calls: int, seconds: float,
                concurrency: int, rounds: int) -> None:
    table = Table(title=f"{calls} calls of a tool that sleeps {seconds:g}s, threads pool "
                        f"-c {concurrency}, {rounds} rounds",
                  caption="wall: first send to last result in hand (median of rounds); send: "
                          "the send loop alone; after send: wall - send, how long the last "
                          "calls took to finish once all were sent; vs raw: median over "
                          "rounds; RSS: worker main + children, idle before the rounds and "
                          "peak while they ran")
    for column in ("store", "variant", "wall s", "vs raw", "send s", "after send s",
                   "idle RSS MB", "peak RSS MB", "failed"):
        table.add_column(column, justify="left" if column in ("store", "variant") else "right")
    for r in rows:
        table.add_row(r["store"], {"raw": "celery", "dex": "dex-tasks call_tool",
                                   "burst": "dex-tasks call_tools"}[r["variant"]],
                      f"{r['wall_s']:.2f}", f"{r['vs_raw']:.2f}x", f"{r['send_s']:.2f}",
                      f"{r['after_send_s']:.2f}",
                      f"{r['idle_rss_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", str(r["failures"]))
    console.print(table)
