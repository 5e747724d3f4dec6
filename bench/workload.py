"""DESIGN's outside workload ("What a call costs (version 4)") beside the old benchmark's, and the
one-factor-at-a-time walk between the two (issue 29).

``python -m bench workload`` runs, per store (SQLite, then PostgreSQL), on one private Redis
with AOF on (``--appendonly yes``) and a fresh store:

* **throughput**: one producer (this process) calls ``call_tool`` for each of 2,000 no-op
  ``read`` calls, call ``i`` in session ``i % 20`` and turn ``i // 20`` (a hundred calls and
  turns per session), then ``wait``s for each in order; plain Celery (JSON, Redis result
  backend) ``delay``s 2,000 no-op tasks then ``get``s each in order. Both workers prefork
  ``-c 2``, ``-l warning``, started once per store; the variants alternate round by round after
  a warm-up of each. The old benchmark's shape (500 calls, ten per session in one turn, Redis
  without AOF) runs in the same run beside it, so the two sets of figures share a machine.
* **CPU per call by process**: user + system time from ``/proc/<pid>/stat`` over each measured
  round: the producer, the worker's main process, its children, Redis, and the database
  server with its backends (PostgreSQL; SQLite runs inside the producer and the children).
* **one call at a time**: ``call_tool`` + ``wait`` against ``apply_async().get()``, interleaved,
  p50 by the caller's clock.
* **the I/O burst**: 1,000 one-second I/O-bound ``read`` calls spread the same way on
  ``--pool threads -c 200``, each polled with ``get_tool_call`` every 20 ms until terminal,
  against Celery's threads pool with 200 threads polled with ``ready()`` as often; also the old
  benchmark's way (``wait`` on each) beside it.

PostgreSQL is a private server started for the run (``shared_preload_libraries =
pg_stat_statements``, ``synchronous_commit`` on), so its CPU is the benchmark's alone; or the
server of ``--postgres-url``, whose CPU is then not counted.

``python -m bench gap`` runs only the throughput part, for the old shape, the old shape with one
factor of DESIGN's changed (AOF, the number of calls, the sessions, a turn per call in a
session), and DESIGN's shape.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.engine import Engine

from bench import raw_tasks
from bench.cpu import CpuMeter, children, fixed, per_call_us, tree
from bench.infra import (
    IO_TOOL,
    READ_TOOL,
    BenchError,
    RedisServer,
    fresh_store,
    median,
    percentile,
    reset_statement_stats,
    statement_stats,
)
from bench.io_bound import IoBench
from bench.latency import one_dex, one_raw
from bench.throughput import WAIT_TIMEOUT, Bench
from dex_tasks import CallStatus
from dex_tasks.store import CALLS, EVENTS, MESSAGES
from dex_tasks.store.tables import event_name

POLL_EVERY = 0.02  # DESIGN: the I/O calls are polled every 20 ms until terminal


@dataclass(frozen=True)
class Shape:
    """How a throughput run's calls are spread: their number, sessions and turns, and whether
    Redis keeps its append-only file."""

    name: str
    calls: int
    sessions: int
    turns: bool  # a turn per call of a session (DESIGN) or one turn for all (the old bench)
    grouped: bool  # consecutive calls share a session (the old bench) or take turns (DESIGN)
    aof: bool

    def place(self, i: int) -> tuple[str, str]:
        """The session and turn of the ``i``-th call."""
        if self.grouped:
            per = math.ceil(self.calls / self.sessions)
            session, step = i // per, i % per
        else:
            session, step = i % self.sessions, i // self.sessions
        return f"s{session}", f"t{step}" if self.turns else "t"

    def describe(self) -> str:
        per = math.ceil(self.calls / self.sessions)
        how = f"{per} turns" if self.turns else "one turn"
        return (f"{self.calls} calls, {self.sessions} sessions of {per} "
                f"({'consecutive' if self.grouped else 'round robin'}, {how}), "
                f"AOF {'on' if self.aof else 'off'}")


DESIGN = Shape("design", 2000, 20, turns=True, grouped=False, aof=True)
OLD = Shape("old", 500, 50, turns=False, grouped=True, aof=False)
# One factor of DESIGN's at a time on the old shape.
GAP = (
    OLD,
    replace(OLD, name="old+aof", aof=True),
    replace(OLD, name="old+2000 calls", calls=2000, sessions=200),
    replace(OLD, name="old+20 sessions", sessions=20, grouped=False),
    replace(OLD, name="old+turns", turns=True),
    replace(DESIGN, name="design-turns", turns=False),
    replace(DESIGN, name="design-aof", aof=False),
    DESIGN,
)


def scaled(shape: Shape, calls: int | None) -> Shape:
    """``shape`` with ``calls`` calls (the sessions scaled alike, at least one), for quick runs."""
    if calls is None or calls == shape.calls:
        return shape
    sessions = max(1, round(shape.sessions * calls / shape.calls))
    return replace(shape, calls=calls, sessions=sessions)


@dataclass
class Run:
    """One variant of one shape in one round: wall time and CPU per process group."""

    store: str
    shape: str
    variant: str
    round: int
    calls: int
    elapsed: float
    cpu: dict[str, float] = field(default_factory=dict)
    failures: int = 0

    @property
    def rate(self) -> float:
        return self.calls / self.elapsed


# -- the servers --------------------------------------------------------------------------------


PRIVATE_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "max_connections": "200"}


@contextmanager
def private_postgres(workdir: Path, settings: dict[str, str] | None = None,
                     ) -> Iterator[tuple[str, int, Callable[[], str]]]:
    """A private PostgreSQL (pg_stat_statements loaded, unless ``settings`` say otherwise):
    (admin URL, postmaster PID, a reader of its log)."""
    from tests.postgres_server import PostgresServer

    server = PostgresServer({**PRIVATE_SETTINGS, **(settings or {})})
    try:
        server.start()
    except (RuntimeError, OSError) as err:
        raise BenchError(f"could not start a private PostgreSQL: {err}") from err
    try:
        assert server.proc is not None
        yield server.url("postgres"), server.proc.pid, server.log
    finally:
        server.stop()


def purge(bench: Bench) -> None:
    """Empty the call, event and message tables and the Celery results between runs."""
    assert bench.client is not None and bench.raw_app is not None
    store = bench.client.store
    with store.write() as conn:
        if store.is_sqlite:
            for table in (EVENTS, MESSAGES, CALLS):
                conn.execute(delete(table))
        else:
            conn.execute(text(f"TRUNCATE {EVENTS.name}, {MESSAGES.name}, {CALLS.name}"))
    bench.raw_app.control.purge()
    results = bench.redis_server.client(2)  # throughput.RAW_BACKEND_DB
    results.flushdb()
    results.close()


def meter_groups(bench: Bench, variant: str, db_pid: int | None) -> dict[str, Any]:
    """The process groups whose CPU a variant's round is charged: its own worker's."""
    import os

    worker = bench.workers[0 if variant == "dex" else 1]
    assert bench.redis_server.proc is not None
    groups = {"producer": fixed(os.getpid()), "worker main": fixed(worker.pid),
              "children": children(worker.pid), "redis": fixed(bench.redis_server.proc.pid)}
    if db_pid is not None and variant == "dex":
        groups["database"] = tree(db_pid)
    return groups


# -- throughput ---------------------------------------------------------------------------------


def run_raw(bench: Bench, calls: int) -> int:
    """``delay`` N no-op tasks, then ``get`` each in order; the failures."""
    assert bench.raw_app is not None
    task = bench.raw_app.tasks[raw_tasks.NOOP]
    results = [task.delay() for _ in range(calls)]
    failures = 0
    for result in results:
        try:
            result.get(timeout=WAIT_TIMEOUT)
        except TimeoutError:
            raise
        except Exception:  # noqa: BLE001 - counted, not fatal
            failures += 1
    for result in results:
        result.forget()
    return failures


def run_dex(bench: Bench, shape: Shape, tag: str) -> int:
    """``call_tool`` each call of ``shape``, then ``wait`` each in order; the failures."""
    assert bench.client is not None
    client = bench.client
    keys = []
    for i in range(shape.calls):
        session, turn = shape.place(i)
        keys.append(client.call_tool(session_id=f"{tag}-{session}", turn_id=turn,
                                     tool_call_id=f"c{i}", tool=READ_TOOL).key)
    return sum(client.wait(key, timeout=WAIT_TIMEOUT).status is not CallStatus.SUCCEEDED
               for key in keys)


def measure(bench: Bench, kind: str, shape: Shape, variant: str, rnd: int,
            db_pid: int | None) -> Run:
    bench.check_alive()
    meter = CpuMeter(meter_groups(bench, variant, db_pid)).start()
    start = time.perf_counter()
    try:
        failures = (run_raw(bench, shape.calls) if variant == "raw"
                    else run_dex(bench, shape, f"{shape.name}-{rnd}"))
    except TimeoutError as err:
        bench.check_alive()
        raise BenchError(f"{shape.name} {variant}: {err}") from err
    elapsed = time.perf_counter() - start
    return Run(kind, shape.name, variant, rnd, shape.calls, elapsed, meter.stop(), failures)


def run_shapes(bench: Bench, kind: str, shapes: list[Shape], rounds: int, warmup: int,
               db_pid: int | None, say: Callable[[str], None],
               statements: list[dict[str, Any]] | None = None) -> list[Run]:
    """Every shape's rounds on one store's workers (raw and dex alternating). ``statements``:
    on a private PostgreSQL, DESIGN's shape's statements per dex-tasks call are added to it
    (:func:`statements_per_call`)."""
    runs: list[Run] = []
    for shape in shapes:
        if bench.redis_server.aof != shape.aof:
            bench.redis_server.set_aof(shape.aof)
        purge(bench)
        run_raw(bench, warmup)
        run_dex(bench, replace(shape, calls=warmup), f"warm-{shape.name}")
        counted = statements is not None and db_pid is not None and shape.name == DESIGN.name
        if counted:
            reset_statements(bench)
        for rnd in range(rounds):
            order = ("raw", "dex") if rnd % 2 == 0 else ("dex", "raw")
            for variant in order:
                say(f"{kind}: {shape.name} round {rnd + 1}/{rounds}, {variant}")
                runs.append(measure(bench, kind, shape, variant, rnd, db_pid))
            purge(bench)
        if counted:
            assert statements is not None
            statements += statements_per_call(bench, rounds * shape.calls)
    return runs


@contextmanager
def statistics(database_url: str) -> Iterator[Engine]:
    """An engine on the store's database that may read pg_stat_statements (the private server
    preloads it; the extension is created in the store's database on first use)."""
    from sqlalchemy import create_engine

    engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        yield engine
    finally:
        engine.dispose()


def reset_statements(bench: Bench) -> None:
    with statistics(bench.database_url) as engine:
        reset_statement_stats(engine)


def per_call_statements(stats: list[dict[str, Any]], calls: int) -> list[dict[str, Any]]:
    """``infra.statement_stats`` rows as figures per call, the costliest first: executions,
    execution time, WAL bytes and shared blocks hit per call, and the statement. Those run
    at least once per ten calls get a row each; the rest (the publish marks' UPDATEs, an IN
    list of a different length each; the sweeps') are summed in one. Execution time leaves
    out each statement's parse, network and commit, which the server's CPU includes."""
    stats = sorted(stats, key=lambda s: -float(s["total_exec_time"]))
    rows = [s for s in stats if int(s["calls"]) * 10 >= calls]
    rest = [s for s in stats if int(s["calls"]) * 10 < calls]
    rows.append({"query": "(every other statement)",
                 **{f: sum(float(s[f]) for s in rest)
                    for f in ("calls", "total_exec_time", "wal_bytes", "shared_blks_hit")}})
    return [{"per_call": round(float(r["calls"]) / calls, 2),
             "exec_us_per_call": round(float(r["total_exec_time"]) * 1000 / calls, 1),
             "wal_bytes_per_call": round(float(r["wal_bytes"]) / calls),
             "blocks_hit_per_call": round(float(r["shared_blks_hit"]) / calls, 1),
             "statement": " ".join(str(r["query"]).split())}
            for r in rows]


def statements_per_call(bench: Bench, calls: int) -> list[dict[str, Any]]:
    """What the server did per dex-tasks call since :func:`reset_statements`, by statement
    on the store's tables (:func:`per_call_statements`, the statement's start only)."""
    with statistics(bench.database_url) as engine:
        stats = statement_stats(engine)
    return [{"store": "postgres", **row, "statement": row["statement"][:110]}
            for row in per_call_statements(stats, calls)]


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    """Per store and shape: dex and raw calls/s (medians), the ratio (median of the rounds'),
    and CPU per call by process group (medians of the rounds)."""
    rows = []
    keys = dict.fromkeys((r.store, r.shape) for r in runs)
    for store, shape in keys:
        dex = [r for r in runs if (r.store, r.shape, r.variant) == (store, shape, "dex")]
        raw = {r.round: r for r in runs if (r.store, r.shape, r.variant) == (store, shape, "raw")}
        row: dict[str, Any] = {
            "store": store, "shape": shape, "calls": dex[0].calls,
            "dex_calls_per_s": round(median([r.rate for r in dex]), 1),
            "raw_calls_per_s": round(median([r.rate for r in raw.values()]), 1),
            "vs_raw": round(median([r.rate / raw[r.round].rate for r in dex]), 3),
            "vs_raw_rounds": [round(r.rate / raw[r.round].rate, 3) for r in dex],
            "failures": sum(r.failures for r in dex) + sum(r.failures for r in raw.values()),
        }
        for variant, group in (("dex", dex), ("raw", list(raw.values()))):
            names = list(group[0].cpu)
            row[f"{variant}_cpu_us_per_call"] = {
                name: round(median([per_call_us(r.cpu, r.calls)[name] for r in group]), 1)
                for name in [*names, "total"]}
        rows.append(row)
    return rows


# -- one call at a time -------------------------------------------------------------------------


def run_one_at_a_time(bench: Bench, kind: str, calls: int) -> dict[str, Any]:
    """``calls`` of each, interleaved: p50 of call_tool + wait vs apply_async().get(), and
    where a dex-tasks call's time goes (:func:`phases`)."""
    raw: list[float] = []
    dex: list[float] = []
    timeline: list[tuple[float, float, float]] = []
    keys: list[str] = []
    for i in range(calls + 5):  # the first five warm both paths
        raw_total = one_raw(bench)[1]
        sent_at = time.time()
        send, dex_total = one_dex(bench, "read", f"one-{kind}", i, keys)
        if i >= 5:
            raw.append(raw_total)
            dex.append(dex_total)
            timeline.append((sent_at, sent_at + send, sent_at + dex_total))
    p50_dex, p50_raw = median(dex), median(raw)
    return {"store": kind, "calls": calls, "dex_p50_ms": round(p50_dex * 1000, 3),
            "raw_p50_ms": round(p50_raw * 1000, 3),
            "dex_p99_ms": round(percentile(dex, 99) * 1000, 3),
            "raw_p99_ms": round(percentile(raw, 99) * 1000, 3),
            "vs_raw": round(p50_dex / p50_raw, 3),
            "phases_p50_ms": phases(bench, keys[5:], timeline)}


PHASES = ("call_tool", "to the worker", "in the worker", "back to the caller")


def phases(bench: Bench, keys: list[str], timeline: list[tuple[float, float, float]],
           ) -> dict[str, float]:
    """The p50 of each phase of a call made alone, in ms: ``call_tool`` (the insert and the
    publish), then until the worker's child starts the attempt (the start its ending records),
    then until the child ends it (the read, the run's lease, the tool), then until ``wait``
    returns (the ending's commit, the announcement, the wake-up and what the waiter reads).
    The marks inside the worker are its event times, taken on this machine's clock."""
    assert bench.client is not None
    started, finished = event_name(CallStatus.RUNNING), event_name(CallStatus.SUCCEEDED)
    marks: dict[str, dict[str, float]] = {}
    with bench.client.store.read() as conn:
        rows = conn.execute(select(EVENTS.c.key, EVENTS.c.event, EVENTS.c.created_at)
                            .where(EVENTS.c.key.in_(keys),
                                   EVENTS.c.event.in_((started, finished))))
        for key, event, at in rows:
            marks.setdefault(key, {})[event] = at
    spans: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for key, (sent, returned, done) in zip(keys, timeline, strict=True):
        start, end = marks[key][started], marks[key][finished]
        for phase, seconds in zip(PHASES, (returned - sent, start - returned, end - start,
                                           done - end), strict=True):
            spans[phase].append(seconds)
    return {phase: round(median(v) * 1000, 3) for phase, v in spans.items()}


# -- the I/O burst ------------------------------------------------------------------------------


def io_raw(io: IoBench, calls: int, seconds: float) -> float:
    """Send ``calls`` sleeps, poll each with ``ready()`` every 20 ms in order: wall seconds."""
    task = io.raw_app.tasks[raw_tasks.SLEEP]
    start = time.perf_counter()
    results = [task.delay(seconds) for _ in range(calls)]
    deadline = time.monotonic() + max(120.0, calls * seconds)
    for result in results:
        while not result.ready():
            if time.monotonic() > deadline:
                raise BenchError("the Celery I/O calls did not all end in time")
            time.sleep(POLL_EVERY)
        result.get(timeout=WAIT_TIMEOUT)
    wall = time.perf_counter() - start
    for result in results:
        result.forget()
    return wall


def io_dex(io: IoBench, shape: Shape, seconds: float, tag: str, polled: bool) -> float:
    """Send the calls of ``shape``; poll each with ``get_tool_call`` every 20 ms until terminal
    (or ``wait`` on each, the old benchmark's way): wall seconds."""
    assert io.client is not None
    client = io.client
    start = time.perf_counter()
    keys = []
    for i in range(shape.calls):
        session, turn = shape.place(i)
        keys.append(client.call_tool(session_id=f"{tag}-{session}", turn_id=turn,
                                     tool_call_id=f"c{i}", tool=IO_TOOL,
                                     arguments={"seconds": seconds}).key)
    deadline = time.monotonic() + max(120.0, shape.calls * seconds)
    for key in keys:
        if not polled:
            record = client.wait(key, timeout=max(1.0, deadline - time.monotonic()))
        else:
            record = client.get_tool_call(key)
            while not record.terminal:
                if time.monotonic() > deadline:
                    raise BenchError(f"I/O call {key} did not end in time")
                time.sleep(POLL_EVERY)
                record = client.get_tool_call(key)
        if record.status is not CallStatus.SUCCEEDED:
            raise BenchError(f"I/O call {key} ended {record.status.value}: {record.error}")
    return time.perf_counter() - start


IO_VARIANTS = ("raw", "dex polled", "dex wait")


def run_io_burst(redis_server: RedisServer, kind: str, url: str, workdir: Path, shape: Shape,
                 seconds: float, concurrency: int, rounds: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """The I/O burst on one store: wall of each variant per round, ratios to Celery's."""
    io = IoBench(redis_server, url, workdir, concurrency, with_dex=True)
    walls: dict[str, list[float]] = {v: [] for v in IO_VARIANTS}
    try:
        io.start()
        for rnd in range(rounds):
            order = IO_VARIANTS if rnd % 2 == 0 else IO_VARIANTS[::-1]
            for variant in order:
                say(f"{kind}: I/O burst round {rnd + 1}/{rounds}, {variant}")
                io.check_alive()
                if variant == "raw":
                    walls[variant].append(io_raw(io, shape.calls, seconds))
                else:
                    walls[variant].append(io_dex(io, shape, seconds, f"io{rnd}-{variant[4:]}",
                                                 polled=variant == "dex polled"))
                io.purge()
    finally:
        io.stop()
    raw = walls["raw"]
    return {"store": kind, "calls": shape.calls, "seconds": seconds,
            "concurrency": concurrency,
            "wall_s": {v: round(median(w), 3) for v, w in walls.items()},
            "wall_rounds_s": {v: [round(x, 3) for x in w] for v, w in walls.items()},
            "vs_raw": {v: round(median([x / r for x, r in zip(w, raw, strict=True)]), 3)
                       for v, w in walls.items() if v != "raw"}}


# -- the whole run ------------------------------------------------------------------------------


@contextmanager
def postgres_for(kind: str, postgres_url: str | None,
                 workdir: Path) -> Iterator[tuple[str | None, int | None]]:
    """The admin URL of the store's server and the PID of a private one (None: not ours)."""
    if kind != "postgres":
        yield None, None
    elif postgres_url:
        yield postgres_url, None
    else:
        with private_postgres(workdir) as (url, pid, _log):
            yield url, pid


@dataclass
class Plan:
    """What one ``workload`` or ``gap`` run measures."""

    shapes: list[Shape]
    rounds: int
    warmup: int
    latency_calls: int = 0  # 0: no one-at-a-time part
    io: Shape | None = None  # None: no I/O burst
    io_seconds: float = 1.0
    io_concurrency: int = 200
    io_rounds: int = 2


def run_plan(plan: Plan, stores: list[str], postgres_url: str | None,
             say: Callable[[str], None]) -> dict[str, Any]:
    """Run ``plan`` on every store; the raw figures (runs, one-at-a-time, I/O, machine)."""
    import os
    import shutil
    import tempfile

    from bench.infra import machine_info, postgres_version

    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-workload-"))
    redis_server = RedisServer(aof=True).start()
    machine = machine_info(redis_server)
    runs: list[Run] = []
    one: list[dict[str, Any]] = []
    io: list[dict[str, Any]] = []
    statements: list[dict[str, Any]] = []
    try:
        for kind in stores:
            with postgres_for(kind, postgres_url, workdir) as (admin, db_pid):
                if admin:
                    machine["postgres_server"] = postgres_version(admin)
                    machine["postgres_private"] = db_pid is not None
                with fresh_store(kind, admin, workdir) as url:
                    say(f"{kind}: starting the workers")
                    bench = Bench(redis_server, url, workdir, "WARNING")
                    try:
                        bench.start()
                        runs += run_shapes(bench, kind, plan.shapes, plan.rounds, plan.warmup,
                                           db_pid, say, statements)
                        if plan.latency_calls:
                            redis_server.set_aof(True)
                            purge(bench)
                            say(f"{kind}: one call at a time")
                            one.append(run_one_at_a_time(bench, kind, plan.latency_calls))
                    finally:
                        bench.stop()
                    if plan.io is not None:
                        redis_server.set_aof(plan.io.aof)
                        io.append(run_io_burst(redis_server, kind, url, workdir, plan.io,
                                               plan.io_seconds, plan.io_concurrency,
                                               plan.io_rounds, say))
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        machine["loadavg_after"] = list(os.getloadavg())
    return {"machine": machine, "runs": runs, "one_at_a_time": one, "io": io,
            "statements": statements}
