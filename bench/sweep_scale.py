"""Sweep scale: how long a sweep takes with a fixed number of due calls among many pending.

For each store and each scale P (10k, 100k, 1M by default) a fresh database is bulk-loaded
(``executemany`` on SQLite, ``COPY`` on PostgreSQL; setup is not timed) with, per job timed:

* ``expire_approvals``: P calls ``awaiting_approval`` with their interrupts;
* ``reap_expired_leases``: P ``running`` read calls;
* ``republish_stranded``: P ``queued`` read calls.

In each population ``repeats`` groups of ``overdue`` calls are due at successive moments
(deadline passed, lease expired, last publish too long ago); the rest are due far in the
future. Sweep ``g`` runs the job with ``now`` just past group ``g``'s moment, so it finds
exactly one group due among about P pending, and nothing the earlier sweeps moved comes back
(rows keep their real statuses: no status is ever reset behind ``transition``'s back). The job
is called until it has moved the whole group (the reaper takes 500 per call); that wall time is
the sweep time. A last call with nothing due gives the cost of an idle sweep.

PostgreSQL tables are ``ANALYZE``d after the load (autovacuum would do it in production);
SQLite gets no statistics, as a deployment would not either.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import Table as SATable
from sqlalchemy import text

from bench.infra import (
    READ_TOOL,
    BenchError,
    RedisServer,
    fresh_store,
    machine_info,
    median,
    save_results,
)
from bench.targets import check, print_targets
from dex_tasks import DexSettings
from dex_tasks.broker.celery_app import create_app
from dex_tasks.broker.routing import WORKER_KEY, worker_record
from dex_tasks.store import CALLS, INTERRUPTS, Store
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import JOBS, reap_expired_leases

DEFAULT_JOBS = ("expire_approvals", "reap_expired_leases", "republish_stranded")
# The one job the issue sets a target for.
TARGET_JOB = "expire_approvals"
POPULATION = {"expire_approvals": "awaiting_approval", "reap_expired_leases": "running",
              "republish_stranded": "queued"}
FAR_FUTURE = 1e7
STEP = 100.0  # seconds between the due moments of successive groups
# Longer than every step, so a call republished by sweep g is not stranded again at sweep g+1.
REPUBLISH_WINDOW = 1e5
CHUNK = 20_000


def parse_scales(value: str, max_pending: int | None = None) -> list[int]:
    """``10000,100000`` (``k``/``M`` suffixes allowed) as a list, capped by ``max_pending``."""
    scales: list[int] = []
    for part in value.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1_000_000 if part.endswith("m") else 1000 if part.endswith("k") else 1
        try:
            scales.append(int(float(part.rstrip("mk")) * mult))
        except ValueError:
            raise BenchError(f"--scales: {part!r} is not a number of pending calls") from None
    if max_pending is not None:
        kept = [s for s in scales if s <= max_pending]
        scales = kept or [max_pending]
    if not scales:
        raise BenchError("--scales names no scale")
    return sorted(set(scales))


def parse_jobs(value: str) -> list[str]:
    jobs = [j.strip() for j in value.split(",") if j.strip()]
    unknown = [j for j in jobs if j not in POPULATION or j not in JOBS]
    if unknown or not jobs:
        raise BenchError(f"--jobs: unknown job(s) {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join(DEFAULT_JOBS)}")
    return jobs


@dataclass
class SweepTiming:
    store: str
    scale: int
    job: str
    seconds: list[float]
    moved: list[int]
    calls: list[int]
    idle_seconds: float

    def summary(self) -> dict[str, Any]:
        return {
            "store": self.store, "scale": self.scale, "job": self.job,
            "median_ms": round(median(self.seconds) * 1000, 3),
            "runs_ms": [round(s * 1000, 3) for s in self.seconds],
            "moved": self.moved, "job_calls": self.calls,
            "idle_ms": round(self.idle_seconds * 1000, 3),
        }


# -- bulk load ----------------------------------------------------------------------------------


def _due_at(base: float, group: int) -> float:
    """When group ``group`` (1-based) becomes due; 0 means never (far future)."""
    return base + group * STEP - STEP / 2 if group else base + FAR_FUTURE


def _group(i: int, overdue: int, repeats: int) -> int:
    return i // overdue + 1 if i < overdue * repeats else 0


def call_rows(job: str, scale: int, overdue: int, repeats: int,
              t0: float) -> Iterator[dict[str, Any]]:
    """The P calls of ``job``'s population (see the module docstring)."""
    prefix = {"expire_approvals": "a", "reap_expired_leases": "r", "republish_stranded": "q"}[job]
    for i in range(scale):
        group = _group(i, overdue, repeats)
        session = f"{prefix}{i // 10}"
        row: dict[str, Any] = {
            "key": f"{session}/t0/c{i}", "session_id": session, "turn_id": "t0",
            "tool_call_id": f"c{i}", "tool": READ_TOOL, "arguments": "{}",
            "effect": "read", "requires_approval": False, "max_attempts": 3,
            "status": POPULATION[job], "attempts": 0, "created_at": t0 - 3600,
            "updated_at": t0 - 3600,
        }
        if job == "expire_approvals":
            row.update(effect="non_idempotent_write", requires_approval=True, max_attempts=1,
                       interrupt_id=f"{prefix}{i:031d}")
        elif job == "reap_expired_leases":
            row.update(attempts=1, worker="bench-gone@host:1",
                       lease_expires_at=_due_at(t0, group))
        else:
            # Stranded means "not published since now - window".
            row["published_at"] = _due_at(t0, group) - REPUBLISH_WINDOW if group else (
                t0 + FAR_FUTURE)
        yield row


def interrupt_rows(scale: int, overdue: int, repeats: int,
                   t0: float) -> Iterator[dict[str, Any]]:
    for i in range(scale):
        session = f"a{i // 10}"
        yield {"interrupt_id": f"a{i:031d}", "key": f"{session}/t0/c{i}",
               "session_id": session, "deadline_at": _due_at(t0, _group(i, overdue, repeats)),
               "created_at": t0 - 3600}


def now_for(t0: float, group: int) -> float:
    """The ``now`` at which exactly groups 1..``group`` are due (for every job)."""
    return t0 + group * STEP


def bulk_insert(store: Store, table: SATable, rows: Iterable[dict[str, Any]]) -> int:
    """Insert ``rows`` fast (COPY on PostgreSQL, executemany on SQLite); returns the count."""
    columns = [c.name for c in table.columns]
    defaults = {c.name: getattr(c.default, "arg", None)
                if c.default is not None and c.default.is_scalar else None
                for c in table.columns}

    def tuples() -> Iterator[tuple[Any, ...]]:
        for row in rows:
            yield tuple(row.get(name, defaults[name]) for name in columns)

    count = 0
    raw = store.engine.raw_connection()
    try:
        cur = raw.cursor()
        names = ", ".join(f'"{c}"' for c in columns)
        if store.is_sqlite:
            # The engine's connections run in autocommit mode (the store issues BEGIN itself).
            cur.execute("BEGIN")
            sql = f"INSERT INTO {table.name} ({names}) VALUES ({', '.join('?' * len(columns))})"
            batch: list[tuple[Any, ...]] = []
            for values in tuples():
                batch.append(values)
                if len(batch) >= CHUNK:
                    cur.executemany(sql, batch)
                    count += len(batch)
                    batch.clear()
            if batch:
                cur.executemany(sql, batch)
                count += len(batch)
            cur.execute("COMMIT")
        else:
            with cur.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:  # type: ignore[attr-defined]
                for values in tuples():
                    copy.write_row(values)
                    count += 1
            raw.commit()
        cur.close()
    finally:
        raw.close()
    return count


# -- timing -------------------------------------------------------------------------------------


def time_job(rt: Runtime, job: str, now: float, expected: int) -> tuple[float, int, int]:
    """Call ``job`` until it has moved ``expected`` calls (or moves none); (seconds, moved,
    calls)."""
    fn = JOBS[job]
    # The reaper waits a second for live workers' renewals before it reaps (see
    # sweeps.reap_expired_leases); no worker runs here, so that wait is left out of the time.
    run = functools.partial(reap_expired_leases, settle=0.0) if fn is reap_expired_leases else fn
    moved = calls = 0
    start = time.perf_counter()
    while True:
        n = run(rt, now)
        calls += 1
        moved += n
        if moved >= expected or n == 0:
            break
    return time.perf_counter() - start, moved, calls


def run_scale(rt: Runtime, store_kind: str, scale: int, jobs: list[str], overdue: int,
              repeats: int, progress: Progress, bar: Any) -> list[SweepTiming]:
    t0 = time.time()
    for job in jobs:
        progress.update(bar, description=f"{store_kind} {scale:,}: loading {job}")
        bulk_insert(rt.store, CALLS, call_rows(job, scale, overdue, repeats, t0))
        if job == "expire_approvals":
            bulk_insert(rt.store, INTERRUPTS, interrupt_rows(scale, overdue, repeats, t0))
    if not rt.store.is_sqlite:
        with rt.store.write() as conn:
            conn.execute(text(f"ANALYZE {CALLS.name}"))
            conn.execute(text(f"ANALYZE {INTERRUPTS.name}"))
    timings = {job: SweepTiming(store_kind, scale, job, [], [], [], 0.0) for job in jobs}
    for group in range(1, repeats + 1):
        for job in jobs:
            progress.update(bar, description=f"{store_kind} {scale:,}: {job} {group}/{repeats}")
            seconds, moved, calls = time_job(rt, job, now_for(t0, group), overdue)
            timings[job].seconds.append(seconds)
            timings[job].moved.append(moved)
            timings[job].calls.append(calls)
            if moved != overdue:
                raise BenchError(f"{job} on {store_kind} at {scale:,} moved {moved} calls, "
                                 f"expected {overdue}: the benchmark's setup is wrong")
    for job in jobs:
        seconds, moved, _ = time_job(rt, job, now_for(t0, repeats + 1), 1)
        if moved:
            raise BenchError(f"{job} on {store_kind} at {scale:,}: the idle sweep moved {moved}")
        timings[job].idle_seconds = seconds
    progress.advance(bar)
    return list(timings.values())


def run_sweeps(
    *,
    scales: list[int],
    overdue: int,
    repeats: int,
    jobs: list[str],
    stores: list[str],
    postgres_url: str | None,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Time each job at each scale on each store; print the tables; write the results."""
    console = console or Console()
    if repeats * STEP >= REPUBLISH_WINDOW / 2:
        raise BenchError(f"--repeats must be below {int(REPUBLISH_WINDOW / 2 / STEP)}")
    small = [s for s in scales if s < overdue * repeats]
    if small:
        raise BenchError(f"--scales: {small[0]} pending cannot hold {repeats} groups of "
                         f"{overdue} overdue calls (lower --overdue or --repeats)")
    redis_server = RedisServer().start()
    machine = machine_info(redis_server, postgres_url if "postgres" in stores else None)
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-sweeps-"))
    timings: list[SweepTiming] = []
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            bar = progress.add_task("sweeps", total=len(stores) * len(scales))
            for kind in stores:
                for scale in scales:
                    with fresh_store(kind, postgres_url, workdir) as url:
                        # The lost-message rule (a call inside its window whose message
                        # Redis holds nowhere is sent at once) is off here: these calls were
                        # inserted with no message, and the sweep's cost by scale is measured.
                        settings = DexSettings(redis_url=redis_server.url(0), database_url=url,
                                               republish_after_seconds=REPUBLISH_WINDOW,
                                               republish_lost_after_seconds=REPUBLISH_WINDOW)
                        store = Store(url)
                        store.create_all()
                        app = create_app(settings)
                        rt = Runtime(settings=settings, store=store,
                                     redis=redis.Redis.from_url(settings.redis_url), app=app)
                        # The republisher sends only calls whose tool a live worker serves:
                        # stand in for a worker's announcement (no worker consumes here).
                        rt.redis.set(WORKER_KEY + "bench", worker_record(
                            "bench", [READ_TOOL], pool="prefork", concurrency=1),
                            ex=24 * 3600)
                        try:
                            timings += run_scale(rt, kind, scale, jobs, overdue, repeats,
                                                 progress, bar)
                        finally:
                            rt.redis.close()
                            app.close()
                            store.close()
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [t.summary() for t in timings]
    growth = growth_rows(timings)
    targets = [check("sweep_growth", g["ratio"], f"{g['store']} {g['span']}",
                     "" if g["full"] else "largest scale below 1M")
               for g in growth if g["job"] == TARGET_JOB]
    print_sweep_table(console, timings, growth, overdue)
    print_targets(console, targets)
    payload = {
        "config": {"scales": scales, "overdue": overdue, "repeats": repeats, "jobs": jobs,
                   "stores": stores},
        "machine": machine,
        "timings": rows,
        "growth": growth,
        "targets": targets,
    }
    return save_results("sweeps", payload, out_dir, console)


def growth_rows(timings: list[SweepTiming]) -> list[dict[str, Any]]:
    """Per store and job: median sweep time at the largest scale over the smallest."""
    out: list[dict[str, Any]] = []
    for store in dict.fromkeys(t.store for t in timings):
        for job in dict.fromkeys(t.job for t in timings):
            mine = sorted((t for t in timings if t.store == store and t.job == job),
                          key=lambda t: t.scale)
            if len(mine) < 2:
                continue
            low, high = mine[0], mine[-1]
            out.append({"store": store, "job": job,
                        "span": f"{_short(high.scale)}/{_short(low.scale)}",
                        "ratio": round(median(high.seconds) / median(low.seconds), 3),
                        "full": high.scale >= 1_000_000 and low.scale <= 10_000})
    return out


def _short(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def print_sweep_table(console: Console, timings: list[SweepTiming],
                      growth: list[dict[str, Any]], overdue: int) -> None:
    table = Table(title=f"Sweep time with {overdue:,} due calls among N pending",
                  caption="median of the timed sweeps; idle: one call with nothing due")
    for column in ("store", "job", "pending", "sweep ms", "runs ms", "job calls", "idle ms"):
        table.add_column(column, justify="left" if column in ("store", "job") else "right")
    for t in timings:
        table.add_row(t.store, t.job, f"{t.scale:,}", f"{median(t.seconds) * 1000:.1f}",
                      " ".join(f"{s * 1000:.0f}" for s in t.seconds),
                      "/".join(str(c) for c in t.calls), f"{t.idle_seconds * 1000:.1f}")
    console.print(table)
    if growth:
        g_table = Table(title="Growth of the sweep time with the number pending")
        for column in ("store", "job", "span", "ratio"):
            g_table.add_column(column)
        for g in growth:
            g_table.add_row(g["store"], g["job"], g["span"], f"{g['ratio']:.2f}x")
        console.print(g_table)
