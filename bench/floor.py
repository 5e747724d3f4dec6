"""``python -m bench floor``: plain Celery, the contract's floor and dex-tasks side by side on
DESIGN's workload (issue 29).

Six variants, on one private Redis with AOF and one fresh store per store kind, each with its
own prefork ``-c 2`` worker at ``-l warning``, alternating round by round:

* ``Celery``: the no-op task, JSON, Redis result backend (``bench/raw_tasks.py``);
* ``floor``: what DESIGN asks of a dex-tasks call of a retrying class (its four statements on
  the store's own tables and indexes, the session's delivery check, the attempt's lease in
  Redis, the announcement), sent by the bare DB-API driver and plain Redis commands, on plain
  Celery with late acks (``bench/floor_tasks.py``);
* three floors under a narrower contract, to price what changing DESIGN would buy, each
  change alone and both together: ``floor, narrow end`` (the ending writes the end's event
  alone, the attempt's start in its detail, no ``tool_call_started`` row, and no tool
  message, a transcript that would read it from the call's row); ``floor, no wait read`` (the
  waiter reads nothing: it trusts the announcement its subscription, made before the call was
  sent, cannot miss); and ``lean floor``, both: three statements a call, not four;
* ``dex-tasks``: ``call_tool`` and ``wait``.

Throughput is DESIGN's: one producer sends 2,000 calls (a hundred calls and turns in each of
20 sessions), then waits for each in order; CPU per call is taken by process from
``/proc/<pid>/stat`` (the database server with its backends on a private PostgreSQL). Then the
same six one call at a time, interleaved so that no call follows one on its own worker
(:data:`ONE_AT_A_TIME`), p50 by the caller's clock.

What lies between Celery and the floor is what the contract's store and Redis work costs,
whoever writes it; what lies between the floor and dex-tasks is dex-tasks' own code (its
Python, SQLAlchemy, the attempt count and metrics kept in Redis, the signed record, policy,
validation and tracing).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from celery import Celery
from rich.console import Console
from rich.table import Table

from bench import floor_tasks
from bench.cpu import CpuMeter, children, fixed, per_call_us, tree
from bench.infra import (
    READ_TOOL,
    BenchError,
    RedisServer,
    WorkerProcess,
    child_env,
    fresh_store,
    machine_info,
    median,
    postgres_version,
    reset_statement_stats,
    save_results,
    statement_stats,
)
from bench.latency import one_dex, one_raw
from bench.throughput import CONCURRENCY, WAIT_TIMEOUT, Bench, celery_command
from bench.workload import (
    DESIGN,
    PHASES,
    Shape,
    per_call_statements,
    postgres_for,
    purge,
    run_dex,
    run_raw,
    scaled,
    statistics,
)
from bench.workload import phases as workload_phases

VARIANTS = ("raw", "floor", "narrow", "noread", "lean", "dex")
LABELS = {"raw": "Celery", "floor": "floor", "narrow": "floor, narrow end",
          "noread": "floor, no wait read", "lean": "lean floor", "dex": "dex-tasks"}
# The floors: (their ending is the narrow one, their waiter reads the call first).
FLOORS = {"floor": (False, True), "narrow": (True, True), "noread": (False, False),
          "lean": (True, False)}
FLOOR_DB = 3  # the private Redis's database of the floor's broker and announcements
CPU_GROUPS = ("producer", "worker main", "children", "redis", "database", "total")
# One call at a time, each measured call right after a call on another worker (the four
# floors share one): a worker that has just run a call starts the next one 0.25-0.3 ms
# sooner, in its main process and its child alike (warm caches and cores, most likely), which
# made "to the worker" of the floors that followed one another on their worker 0.3-0.4 ms
# shorter than dex-tasks', whose worker had sat idle for five calls (issue 29). Celery and
# dex-tasks run twice a turn to keep the floors apart.
ONE_AT_A_TIME = ("raw", "noread", "dex", "floor", "raw", "narrow", "dex", "lean")


@dataclass
class FloorBench:
    """The floor's worker and the producer's side of it, beside a store's :class:`Bench`."""

    bench: Bench
    database_url: str
    worker: WorkerProcess | None = None
    app: Celery | None = None
    floor: floor_tasks.Floor | None = None
    waiter: floor_tasks.Waiter | None = None
    sent: int = field(default=0)

    def start(self) -> FloorBench:
        broker = self.bench.redis_server.url(FLOOR_DB)
        env = child_env({"BENCH_FLOOR_BROKER": broker,
                         "BENCH_FLOOR_DATABASE": self.database_url})
        tag = uuid.uuid4().hex[:6]
        self.worker = WorkerProcess.start(
            "celery", [*celery_command(), "-A", "bench.floor_tasks", "worker",
                       "-c", str(CONCURRENCY), "-P", "prefork", "-Q", floor_tasks.QUEUE,
                       "-n", f"bench-floor-{tag}@%h", "--without-gossip", "--without-mingle",
                       "--loglevel", "WARNING"],
            env, self.bench.workdir / f"floor-worker-{tag}.log")
        self.app = floor_tasks.create_app(broker)
        self.floor = floor_tasks.Floor(self.database_url)
        self.waiter = floor_tasks.Waiter(broker)
        self.worker.wait_children(CONCURRENCY)
        return self

    def check_alive(self) -> None:
        self.bench.check_alive()
        assert self.worker is not None
        self.worker.check_alive()

    def send(self, session_id: str, turn_id: str, tool_call_id: str, variant: str) -> str:
        """The ``call_tool`` of the floor ``variant``: the row, then the message; the key."""
        assert self.app is not None and self.floor is not None
        self.sent += 1
        key = f"floor-{os.getpid()}-{self.sent}"
        self.floor.insert(key, session_id, turn_id, tool_call_id, READ_TOOL)
        narrow, _ = FLOORS[variant]
        task = floor_tasks.LEAN_TASK if narrow else floor_tasks.TASK
        self.app.tasks[task].apply_async(args=[key])
        return key

    def wait(self, key: str, variant: str) -> None:
        assert self.waiter is not None and self.floor is not None
        _, read = FLOORS[variant]
        self.waiter.wait(self.floor, key, WAIT_TIMEOUT, read=read)

    def stop(self) -> None:
        if self.waiter is not None:
            self.waiter.close()
        if self.floor is not None:
            self.floor.close()
        if self.worker is not None:
            self.worker.stop()


def run_floor(fb: FloorBench, shape: Shape, tag: str, variant: str) -> None:
    """DESIGN's rounds on the floor ``variant``: send each call, then wait for each in
    order."""
    keys = []
    for i in range(shape.calls):
        session, turn = shape.place(i)
        keys.append(fb.send(f"{tag}-{session}", turn, f"c{i}", variant))
    for key in keys:
        fb.wait(key, variant)


def one_floor(fb: FloorBench, i: int, keys: list[str], variant: str) -> tuple[float, float]:
    """One call of the floor ``variant`` made alone: (send, total) seconds, as
    ``latency.one_dex`` gives them; its key is appended to ``keys``."""
    t0 = time.perf_counter()
    key = fb.send(f"one-floor-{i // 10}", "t", f"c{i}", variant)
    t1 = time.perf_counter()
    keys.append(key)
    fb.wait(key, variant)
    return t1 - t0, time.perf_counter() - t0


def groups(fb: FloorBench, variant: str, db_pid: int | None) -> dict[str, Any]:
    """The processes a variant's round is charged: the producer, its worker, Redis, and the
    database server for those that use it."""
    bench = fb.bench
    worker = (fb.worker if variant in FLOORS else
              {"dex": bench.workers[0], "raw": bench.workers[1]}[variant])
    assert worker is not None and bench.redis_server.proc is not None
    out = {"producer": fixed(os.getpid()), "worker main": fixed(worker.pid),
           "children": children(worker.pid), "redis": fixed(bench.redis_server.proc.pid)}
    if db_pid is not None and variant != "raw":
        out["database"] = tree(db_pid)
    return out


def measure(fb: FloorBench, variant: str, shape: Shape, tag: str,
            db_pid: int | None) -> dict[str, Any]:
    """One round of one variant: calls/s and CPU per call by process (and, on a private
    PostgreSQL, what the server ran for it)."""
    fb.check_alive()
    with ExitStack() as stack:
        statements = None
        if db_pid is not None and variant != "raw":
            statements = stack.enter_context(statistics(fb.database_url))
            reset_statement_stats(statements)
        meter = CpuMeter(groups(fb, variant, db_pid)).start()
        start = time.perf_counter()
        try:
            if variant == "raw":
                failures = run_raw(fb.bench, shape.calls)
            elif variant == "dex":
                failures = run_dex(fb.bench, shape, tag)
            else:
                run_floor(fb, shape, tag, variant)
                failures = 0
        except TimeoutError as err:
            fb.check_alive()
            raise BenchError(f"{variant}: {err}") from err
        elapsed = time.perf_counter() - start
        cpu = per_call_us(meter.stop(), shape.calls)
        if failures:
            raise BenchError(f"{variant}: {failures} of {shape.calls} calls failed")
        run = {"variant": variant, "calls": shape.calls, "elapsed_s": elapsed,
               "rate": shape.calls / elapsed, "cpu_us": cpu}
        if statements is not None:
            run["statements"] = per_call_statements(statement_stats(statements), shape.calls)
        return run


def run_store(fb: FloorBench, kind: str, shape: Shape, rounds: int, warmup: int,
              latency_calls: int, db_pid: int | None, say: Any) -> dict[str, Any]:
    """Every round of every variant on one store, then one call at a time."""
    runs: list[dict[str, Any]] = []
    purge(fb.bench)
    warm = replace(shape, calls=warmup)
    run_raw(fb.bench, warmup)
    run_dex(fb.bench, warm, f"warm-{kind}")
    for variant in FLOORS:
        run_floor(fb, warm, f"warm-{variant}-{kind}", variant)
    for rnd in range(rounds):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
        for variant in order:
            say(f"{kind}: round {rnd + 1}/{rounds}, {LABELS[variant]}")
            runs.append({"round": rnd, **measure(fb, variant, shape, f"{kind}{rnd}", db_pid)})
        purge(fb.bench)
    one: dict[str, list[float]] = {v: [] for v in VARIANTS}
    keys: dict[str, list[str]] = {v: [] for v in VARIANTS if v != "raw"}
    timeline: dict[str, list[tuple[float, float, float]]] = {v: [] for v in keys}
    if latency_calls:
        say(f"{kind}: one call at a time")
    for i in range(latency_calls + 5):  # the first five warm each path
        for turn, variant in enumerate(ONE_AT_A_TIME):
            warm_up = i < 5
            if variant == "raw":
                total = one_raw(fb.bench)[1]
                if not warm_up:
                    one["raw"].append(total)
                continue
            sent_at = time.time()
            mine: list[str] = [] if warm_up else keys[variant]
            # Each turn of a variant in the order its own calls (a repeated id would be a
            # repeat of the call, which runs nothing).
            send, total = (one_dex(fb.bench, "read", f"one-{kind}-{turn}", i, mine)
                           if variant == "dex" else one_floor(fb, i, mine, variant))
            if not warm_up:
                one[variant].append(total)
                timeline[variant].append((sent_at, sent_at + send, sent_at + total))
    # Where each one's time goes, from the events its ending wrote (the narrow endings write
    # no start event).
    phases = {v: workload_phases(fb.bench, keys[v], timeline[v])
              for v in ("floor", "noread", "dex") if latency_calls}
    return summarize(kind, runs, one, phases)


def summarize(kind: str, runs: list[dict[str, Any]], one: dict[str, list[float]],
              phases: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per variant: calls/s and CPU per call (medians of the rounds), each round's ratio to
    Celery's of the same round; one call at a time p50 and its ratio."""
    raw = {r["round"]: r for r in runs if r["variant"] == "raw"}
    rows = []
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        cpu = {name: round(median([r["cpu_us"].get(name, 0.0) for r in mine]), 1)
               for name in CPU_GROUPS}
        ratios = [r["rate"] / raw[r["round"]]["rate"] for r in mine]
        p50 = median(one[variant]) if one[variant] else None
        raw_p50 = median(one["raw"]) if one["raw"] else None
        rows.append({
            "store": kind, "variant": variant,
            "calls_per_s": round(median([r["rate"] for r in mine]), 1),
            "vs_raw": round(median(ratios), 3), "vs_raw_rounds": [round(x, 3) for x in ratios],
            "cpu_us_per_call": cpu,
            "one_p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "one_vs_raw": None if p50 is None or not raw_p50 else round(p50 / raw_p50, 3),
            "statements": mine[-1].get("statements", []),
            "phases_p50_ms": phases.get(variant, {}),
        })
    return {"store": kind, "rows": rows,
            "runs": [{**{k: v for k, v in r.items() if k != "statements"},
                      "elapsed_s": round(r["elapsed_s"], 4), "rate": round(r["rate"], 1),
                      "cpu_us": {k: round(v, 1) for k, v in r["cpu_us"].items()}}
                     for r in runs]}


def _table(title: str, columns: tuple[str, ...], text: tuple[str, ...]) -> Table:
    """A table of ``columns``, the ``text`` ones left-justified and the figures right."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in text else "right")
    return table


def print_tables(console: Console, stores: list[dict[str, Any]]) -> None:
    table = _table("DESIGN's throughput: Celery, the contract's floor (its store and Redis work "
                   "by the bare clients on plain Celery), floors under a narrower contract, "
                   "dex-tasks",
                   ("store", "variant", "calls/s", "vs Celery", "rounds",
                    *(f"{g} µs" for g in CPU_GROUPS), "one p50 ms", "one vs Celery"),
                   ("store", "variant"))
    for store in stores:
        for row in store["rows"]:
            cpu = row["cpu_us_per_call"]
            table.add_row(row["store"], LABELS[row["variant"]], f"{row['calls_per_s']:.0f}",
                          f"{row['vs_raw']:.2f}x",
                          ", ".join(f"{x:.2f}" for x in row["vs_raw_rounds"]),
                          *(f"{cpu[g]:,.0f}" if cpu[g] else "-" for g in CPU_GROUPS),
                          "-" if row["one_p50_ms"] is None else f"{row['one_p50_ms']:.2f}",
                          "-" if row["one_vs_raw"] is None else f"{row['one_vs_raw']:.2f}x")
    table.caption = ("CPU: user + system per call from /proc/<pid>/stat, medians of the rounds; "
                     "database: the private PostgreSQL server and its backends (SQLite runs "
                     "inside the producer and the children)")
    console.print(table)
    phases = _table("One call at a time: where the floor's and dex-tasks' time goes, p50 ms of "
                    "each phase", ("store", "variant", *PHASES), ("store", "variant"))
    for store in stores:
        for row in store["rows"]:
            if row["phases_p50_ms"]:
                phases.add_row(row["store"], LABELS[row["variant"]],
                               *(f"{row['phases_p50_ms'][p]:.2f}" for p in PHASES))
    if phases.row_count:
        phases.caption = ("call_tool: the insert and the publish; to the worker: until its child "
                          "starts the attempt; in the worker: the call's read, its lease, the "
                          "tool; back: the ending's commit, the announcement, the wake-up")
        console.print(phases)
    statements = _table("PostgreSQL per call, the last round's statements (pg_stat_statements "
                        "on the private server)",
                        ("variant", "runs per call", "exec µs per call", "WAL bytes per call",
                         "blocks hit per call", "statement"), ("variant", "statement"))
    for store in stores:
        for row in store["rows"]:
            for stmt in row["statements"]:
                statements.add_row(LABELS[row["variant"]], f"{stmt['per_call']:.2f}",
                                   f"{stmt['exec_us_per_call']:.1f}",
                                   f"{stmt['wal_bytes_per_call']:,}",
                                   f"{stmt['blocks_hit_per_call']:.1f}",
                                   stmt["statement"][:90])
    if statements.row_count:
        statements.caption = ("exec: the executor's time alone (no parse, network or commit, "
                              "which the database's CPU above includes)")
        console.print(statements)


def run_floor_bench(*, calls: int | None, rounds: int, stores: list[str],
                    postgres_url: str | None, warmup: int, latency_calls: int, command: str,
                    out_dir: Path | None = None,
                    console: Console | None = None) -> dict[str, Any]:
    """The three variants on every store; prints the table and writes the JSON results."""
    if rounds < 1 or warmup < 1 or latency_calls < 0:
        raise BenchError("--rounds and --warmup must be at least 1, --latency-calls not "
                         "negative")
    console = console or Console()
    shape = scaled(DESIGN, calls)
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-floor-"))
    redis_server = RedisServer(aof=True).start()
    machine = machine_info(redis_server)
    results: list[dict[str, Any]] = []
    try:
        for kind in stores:
            with ExitStack() as stack:
                admin, db_pid = stack.enter_context(postgres_for(kind, postgres_url, workdir))
                if admin:
                    machine["postgres_server"] = postgres_version(admin)
                url = stack.enter_context(fresh_store(kind, admin, workdir))
                console.log(f"{kind}: starting the workers")
                bench = Bench(redis_server, url, workdir, "WARNING")
                stack.callback(bench.stop)
                bench.start()  # the dex-tasks worker makes the store's tables
                fb = FloorBench(bench, url)
                stack.callback(fb.stop)
                fb.start()
                results.append(run_store(fb, kind, shape, rounds, warmup, latency_calls,
                                         db_pid, lambda s: console.log(s)))
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        machine["loadavg_after"] = list(os.getloadavg())
    console.print(f"[bold]{command}[/bold]")
    print_tables(console, results)
    payload = {"command": command, "machine": machine,
               "config": {"shape": shape.describe(), "calls": shape.calls, "rounds": rounds,
                          "warmup": warmup, "latency_calls": latency_calls,
                          "workers": "prefork -c 2 -l warning each", "stores": stores},
               "stores": results}
    return save_results("floor", payload, out_dir, console)
