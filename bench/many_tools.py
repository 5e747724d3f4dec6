"""Many tools: does a catalog of hundreds of tools make idle workers, Redis or calls slower?

One queue per tool means a worker's ``BRPOP`` names every queue it serves, once per priority
step kombu listens on, and sends that list again after every message and every
``brpop_timeout`` when idle. For each catalog size (5, 50, 500 tools by default), on a
private Redis and a fresh SQLite store, with one ``dex-tasks worker -c 2 -l warning``:

* idle: the worker's CPU (main process and children, from ``/proc``) and Redis's (``INFO
  cpu``) per second, and Redis commands per second, over ``--idle`` seconds;
* one call at a time: ``call_tool`` + ``wait`` p50 and p95, calls spread over every tool;
* a burst: ``--burst`` calls sent together, spread over every tool: calls/s, Redis CPU per
  call, and the keys each ``BRPOP`` named (from ``INFO commandstats``).

Nothing is asserted: the table is the finding, and the command that printed it is the one to
run again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from bench.catalog_tools import COUNT_ENV, tool_name
from bench.infra import (
    BenchError,
    RedisServer,
    WorkerProcess,
    child_env,
    fresh_store,
    machine_info,
    percentile,
    save_results,
    wait_for_catalog,
)
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.ops.procutil import dex_command

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class CatalogRun:
    """The figures of one catalog size."""

    tools: int
    idle_worker_cpu_ms_per_s: float
    idle_redis_cpu_ms_per_s: float
    idle_redis_commands_per_s: float
    latency_p50_ms: float
    latency_p95_ms: float
    burst_calls_per_s: float
    burst_redis_cpu_us_per_call: float
    burst_worker_cpu_us_per_call: float
    brpop_keys: int


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (from ``/proc/<pid>/stat``)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    return total


def redis_cpu_seconds(client: redis.Redis) -> float:
    """Redis's own user + system CPU seconds (its main thread and its helpers)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def redis_commands(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def brpop_keys(server: RedisServer, timeout: float = 10.0, window: float = 2.5) -> int:
    """How many keys an idle worker's pool consumer names in its ``BRPOP``, read off
    ``MONITOR`` (an idle consumer sends it again every second): the most seen within
    ``window`` seconds of the first, since the main process's webhook sender BRPOPs its own
    one queue too."""
    client = server.client()
    deadline = time.monotonic() + timeout
    most = 0
    try:
        with client.monitor() as monitor:  # type: ignore[no-untyped-call]
            for event in monitor.listen():
                command = str(event.get("command", ""))
                if command.upper().startswith("BRPOP "):
                    # The keys, then the timeout: quoted words, none with a space in them.
                    if not most:
                        deadline = min(deadline, time.monotonic() + window)
                    most = max(most, len(command.split()) - 2)
                if time.monotonic() > deadline:
                    return most
    finally:
        client.close()
    return most


def measure(count: int, *, idle: float, latency_calls: int, burst: int, workdir: Path,
            console: Console) -> CatalogRun:
    """Start a worker with ``count`` tools and take the figures."""
    server = RedisServer().start()
    try:
        with fresh_store("sqlite", None, workdir) as url:
            env = child_env({"DEX_REDIS_URL": server.url(0), "DEX_DATABASE_URL": url,
                             COUNT_ENV: str(count)})
            worker = WorkerProcess.start(
                "dex-tasks", [*dex_command(), "worker", "--tools", "bench.catalog_tools",
                              "-c", "2", "--loglevel", "WARNING"],
                env, workdir / f"worker-{count}.log")
            client = DexClient(DexSettings(redis_url=server.url(0), database_url=url),
                               create_tables=False)
            try:
                return _drive(client, worker, server, count, idle=idle,
                              latency_calls=latency_calls, burst=burst, console=console)
            finally:
                client.close()
                worker.stop()
    finally:
        server.stop()


def _drive(client: DexClient, worker: WorkerProcess, server: RedisServer, count: int, *,
           idle: float, latency_calls: int, burst: int, console: Console) -> CatalogRun:
    wait_for_catalog(client, tool_name(count - 1), worker.check_alive)
    worker.wait_children(2)
    watcher = server.client()
    # Warm every child and connection, then let the worker settle into idling.
    for i in range(4):
        _one(client, f"warm-{i}", tool_name(i % count))
    time.sleep(1.0)
    keys = brpop_keys(server)

    pids = [worker.pid, *worker.children()]
    cpu0, rcpu0, cmd0 = process_cpu_seconds(pids), redis_cpu_seconds(watcher), \
        redis_commands(watcher)
    time.sleep(idle)
    cpu1, rcpu1, cmd1 = process_cpu_seconds(pids), redis_cpu_seconds(watcher), \
        redis_commands(watcher)

    latencies = []
    for i in range(latency_calls):
        started = time.perf_counter()
        _one(client, f"lat-{i}", tool_name(i * 7 % count))
        latencies.append((time.perf_counter() - started) * 1000)

    pids = [worker.pid, *worker.children()]
    cpu2, rcpu2 = process_cpu_seconds(pids), redis_cpu_seconds(watcher)
    started = time.perf_counter()
    sent = [client.call_tool(session_id=f"burst-{i % 20}", turn_id=f"t{i // 20}",
                             tool_call_id=f"c{i}", tool=tool_name(i % count)).key
            for i in range(burst)]
    failed = sum(client.wait(key, timeout=300).status is not CallStatus.SUCCEEDED
                 for key in sent)
    elapsed = time.perf_counter() - started
    cpu3, rcpu3 = process_cpu_seconds(pids), redis_cpu_seconds(watcher)
    watcher.close()
    if failed:
        raise BenchError(f"{failed} of the burst's {burst} calls did not succeed")
    return CatalogRun(
        tools=count,
        idle_worker_cpu_ms_per_s=(cpu1 - cpu0) / idle * 1000,
        idle_redis_cpu_ms_per_s=(rcpu1 - rcpu0) / idle * 1000,
        idle_redis_commands_per_s=(cmd1 - cmd0) / idle,
        latency_p50_ms=percentile(latencies, 50),
        latency_p95_ms=percentile(latencies, 95),
        burst_calls_per_s=burst / elapsed,
        burst_redis_cpu_us_per_call=(rcpu3 - rcpu2) / burst * 1e6,
        burst_worker_cpu_us_per_call=(cpu3 - cpu2) / burst * 1e6,
        brpop_keys=keys,
    )


def _one(client: DexClient, call_id: str, tool: str) -> None:
    record = client.call_tool(session_id="one-at-a-time", turn_id=call_id,
                              tool_call_id=call_id, tool=tool)
    final = client.wait(record.key, timeout=60)
    if final.status is not CallStatus.SUCCEEDED:
        raise RuntimeError(f"{tool} ended {final.status.value}: {final.error}")


def run_many_tools(*, counts: list[int], idle: float, latency_calls: int, burst: int,
                   out_dir: Path | None = None, console: Console | None = None
                   ) -> dict[str, Any]:
    """Measure each catalog size in turn; print the table and write the results."""
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-tools-"))
    machine = machine_info()
    try:
        runs = [measure(n, idle=idle, latency_calls=latency_calls, burst=burst,
                        workdir=workdir, console=console) for n in counts]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine["loadavg_after"] = list(os.getloadavg())
    table = Table(title=f"many tools: python -m bench tools --counts "
                        f"{','.join(map(str, counts))} --idle {idle:g} --burst {burst}")
    for column in ("tools", "BRPOP keys", "idle worker CPU ms/s", "idle Redis CPU ms/s",
                   "idle Redis cmds/s", "one call p50 ms", "p95 ms", "burst calls/s",
                   "Redis µs/call", "worker µs/call"):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(str(run.tools), str(run.brpop_keys),
                      f"{run.idle_worker_cpu_ms_per_s:.2f}", f"{run.idle_redis_cpu_ms_per_s:.2f}",
                      f"{run.idle_redis_commands_per_s:.1f}", f"{run.latency_p50_ms:.2f}",
                      f"{run.latency_p95_ms:.2f}", f"{run.burst_calls_per_s:.0f}",
                      f"{run.burst_redis_cpu_us_per_call:.0f}",
                      f"{run.burst_worker_cpu_us_per_call:.0f}")
    console.print(table)
    console.print(f"load average before / after: {machine['loadavg']} / "
                  f"{machine['loadavg_after']}")
    return save_results("many_tools", {"machine": machine,
                                       "runs": [asdict(r) for r in runs]}, out_dir, console)
