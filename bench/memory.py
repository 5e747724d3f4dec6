"""Memory: the resident memory of a ``dex-tasks worker -c 2`` (main process plus children, from
``/proc``) before and after N calls, as MB per 100k calls.

Calls alternate by batch between the no-op ``read`` tool and the no-op single-attempt tool, so
both task kinds run. ``batch`` calls are in flight at a time (sent, then waited on). The first
sample is taken after ``warmup`` calls, once imports, connection pools and caches have settled;
RSS is sampled after every batch, and besides the before/after difference the slope of a
least-squares line through the samples is reported, which one allocator step moves less.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

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
    rss_bytes,
    save_results,
    wait_for_catalog,
)
from bench.targets import check, print_targets
from bench.throughput import session_for
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.ops.procutil import dex_command

MB = 1024 * 1024
PER = 100_000
CONCURRENCY = 2


def run_batch(client: DexClient, session: str, tool: str, start: int, count: int) -> int:
    """``count`` calls sent, then waited on; returns how many did not succeed."""
    keys = [client.call_tool(session_id=session_for(session, start + i), turn_id="t",
                             tool_call_id=f"c{start + i}", tool=tool).key for i in range(count)]
    return sum(client.wait(k, timeout=120).status != CallStatus.SUCCEEDED for k in keys)


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope (bytes per call) of (calls, rss) samples."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return float("nan")
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var


def run_memory(
    *,
    calls: int,
    warmup: int,
    batch: int,
    store: str,
    postgres_url: str | None,
    loglevel: str = "WARNING",
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the calls against one worker, sampling its RSS; print and write the results."""
    console = console or Console()
    redis_server = RedisServer().start()
    machine = machine_info(redis_server, postgres_url if store == "postgres" else None)
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-memory-"))
    samples: list[tuple[int, int]] = []
    failures = 0
    try:
        with fresh_store(store, postgres_url, workdir) as url:
            env = child_env({"DEX_REDIS_URL": redis_server.url(0), "DEX_DATABASE_URL": url})
            worker = WorkerProcess.start(
                "dex-tasks", [*dex_command(), "worker", "--tools", TOOLS_MODULE,
                              "-c", str(CONCURRENCY), "--loglevel", loglevel],
                env, workdir / "worker.log")
            client = DexClient(DexSettings(redis_url=redis_server.url(0), database_url=url),
                               create_tables=False)
            try:
                failures, samples, pids = _drive(client, worker, calls, warmup, batch, console)
            finally:
                client.close()
                worker.stop()
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    before, after = samples[0][1], samples[-1][1]
    measured = samples[-1][0] - samples[0][0]
    growth_per = (after - before) / MB / measured * PER
    slope_per = slope(samples) / MB * PER
    note = f"slope {slope_per:.2f} MB/100k" + ("" if measured >= PER else
                                               f"; {measured:,} calls, scaled to 100k")
    if pids["restarted"]:
        note += "; a child was replaced during the run"
    targets = [check("rss_growth", growth_per, f"{store} worker -c {CONCURRENCY}", note)]
    table = Table(title=f"Worker RSS (main + {CONCURRENCY} children) over {measured:,} calls")
    for column in ("store", "before MB", "after MB", "growth MB", "MB per 100k",
                   "slope MB per 100k", "failed"):
        table.add_column(column, justify="left" if column == "store" else "right")
    table.add_row(store, f"{before / MB:.1f}", f"{after / MB:.1f}",
                  f"{(after - before) / MB:.2f}", f"{growth_per:.2f}", f"{slope_per:.2f}",
                  str(failures))
    console.print(table)
    print_targets(console, targets)
    payload = {
        "config": {"calls": calls, "warmup": warmup, "batch": batch, "store": store,
                   "worker_concurrency": CONCURRENCY, "worker_loglevel": loglevel},
        "machine": machine,
        "rss_before_mb": round(before / MB, 3),
        "rss_after_mb": round(after / MB, 3),
        "mb_per_100k": round(growth_per, 3),
        "slope_mb_per_100k": round(slope_per, 3),
        "samples": [{"calls": c, "rss_mb": round(r / MB, 3)} for c, r in samples],
        "pids": pids,
        "client_rss_mb": round(rss_bytes(os.getpid()) / MB, 3),
        "failures": failures,
        "targets": targets,
    }
    return save_results("memory", payload, out_dir, console)


def _drive(client: DexClient, worker: WorkerProcess, calls: int, warmup: int, batch: int,
           console: Console) -> tuple[int, list[tuple[int, int]], dict[str, Any]]:
    wait_for_catalog(client, SINGLE_ATTEMPT_TOOL, worker.check_alive)
    first_children = worker.wait_children(CONCURRENCY)
    session = f"mem-{uuid.uuid4().hex[:6]}"
    tools = (READ_TOOL, SINGLE_ATTEMPT_TOOL)
    failures = 0
    done = 0
    samples: list[tuple[int, int]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task("warm-up", total=warmup + calls)
        n_batch = 0
        while done < warmup + calls:
            if done >= warmup and not samples:
                progress.update(bar, description="measuring")
                samples.append((0, worker.rss_bytes()[0]))
            end = warmup if done < warmup else warmup + calls
            count = min(batch, end - done)
            worker.check_alive()
            try:
                failures += run_batch(client, session, tools[n_batch % 2], done, count)
            except TimeoutError as err:
                worker.check_alive()
                raise BenchError(f"memory: {err}") from err
            n_batch += 1
            done += count
            progress.advance(bar, count)
            if done > warmup:
                samples.append((done - warmup, worker.rss_bytes()[0]))
    last_children = worker.children()
    pids = {"main": worker.pid, "children_first": first_children,
            "children_last": last_children,
            "restarted": sorted(first_children) != sorted(last_children)}
    return failures, samples, pids
