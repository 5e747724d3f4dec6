"""What ``dex-tasks mcp`` adds to a call: the same no-op read called in process
(``call_tool`` + ``wait``), through ``dex-tasks mcp`` over stdio, and over streamable HTTP,
each by the caller's clock, one call at a time, interleaved call by call (in process, stdio,
http, in process, ...) so drift in the machine's load falls on all three alike.

The MCP clients are the ``mcp`` SDK's own, connected once (the handshake is not timed); each
call has its own ``_meta`` ids. Workers: one ``dex-tasks worker --tools bench.noop_tools -c 2``
on a private Redis and a SQLite store.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from rich.console import Console
from rich.table import Table

from bench.infra import (
    READ_TOOL,
    TOOLS_MODULE,
    BenchError,
    WorkerProcess,
    bench_session,
    child_env,
    fresh_store,
    median,
    percentile,
    save_results,
    wait_for,
    wait_for_catalog,
)
from dex_tasks import AsyncDexClient, DexClient, DexSettings, issue_token
from dex_tasks.ops.procutil import dex_command, free_port

VARIANTS = ("in_process", "stdio", "http")
SECRET = "bench-secret"


async def _timed_calls(clients: dict[str, Any], dex: AsyncDexClient, calls: int,
                       offset: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(offset, offset + calls):
        order = VARIANTS[i % 3:] + VARIANTS[:i % 3]
        for variant in order:
            ids = {"dex/turn_id": f"t-{variant}", "dex/tool_call_id": f"c{i}"}
            t0 = time.perf_counter()
            if variant == "in_process":
                record = await dex.call_tool(session_id="bench", turn_id=ids["dex/turn_id"],
                                             tool_call_id=ids["dex/tool_call_id"], tool=READ_TOOL)
                record = await dex.wait(record.key, timeout=30)
                failed = record.status.value != "succeeded"
            else:
                result = await clients[variant].call_tool(READ_TOOL, {}, meta=ids)
                failed = bool(result.is_error)
            samples[variant].append(time.perf_counter() - t0)
            if failed:
                raise BenchError(f"{variant}: call {i} failed")
    return samples


async def _measure(env: dict[str, str], url: str, calls: int, warmup: int,
                   settings: DexSettings) -> dict[str, list[float]]:
    command = dex_command()
    token = issue_token(SECRET, "bench")
    async with AsyncExitStack() as stack:
        dex = AsyncDexClient(settings, create_tables=False)
        stack.push_async_callback(dex.close)
        stdio = await stack.enter_async_context(Client(stdio_client(StdioServerParameters(
            command=command[0], args=[*command[1:], "mcp", "--session", "bench"], env=env))))
        http = await stack.enter_async_context(httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30)))
        remote = await stack.enter_async_context(
            Client(streamable_http_client(url, http_client=http)))
        clients = {"stdio": stdio, "http": remote}
        await _timed_calls(clients, dex, warmup, 0)
        return await _timed_calls(clients, dex, calls, warmup)


def run_mcp_latency(*, calls: int, warmup: int = 20, out_dir: Path | None = None,
                    console: Console | None = None) -> dict[str, Any]:
    """Time the three ways to call; print the table; write the results."""
    console = console or Console()
    with bench_session("mcp", ["sqlite"], None) as (redis_server, machine, workdir), \
            fresh_store("sqlite", None, workdir) as database_url:
        settings = DexSettings(redis_url=redis_server.url(0), database_url=database_url,
                               secret_key=SECRET)  # type: ignore[arg-type]
        env = child_env({"DEX_REDIS_URL": settings.redis_url, "DEX_DATABASE_URL": database_url,
                         "DEX_SECRET_KEY": SECRET})
        worker = WorkerProcess.start(
            "dex-tasks", [*dex_command(), "worker", "--tools", TOOLS_MODULE, "-c", "2",
                          "--loglevel", "WARNING"], env, workdir / "worker.log")
        port = free_port()
        server = WorkerProcess.start(
            "dex-tasks mcp", [*dex_command(), "mcp", "--http", "--port", str(port)], env,
            workdir / "mcp.log")
        url = f"http://127.0.0.1:{port}/mcp"
        try:
            with DexClient(settings, create_tables=False) as probe:
                wait_for_catalog(probe, READ_TOOL, worker.check_alive)
            worker.wait_children(2)
            wait_for(lambda: _listening(url, server), 60, "dex-tasks mcp --http to listen")
            with console.status(f"mcp latency: {calls} calls per variant"):
                samples = asyncio.run(_measure(env, url, calls, warmup, settings))
        finally:
            server.stop()
            worker.stop()
    base = median(samples["in_process"])
    rows: list[dict[str, Any]] = [
        {"variant": v, "calls": len(s), "p50_ms": round(percentile(s, 50) * 1000, 3),
         "p99_ms": round(percentile(s, 99) * 1000, 3),
         "added_p50_ms": round((median(s) - base) * 1000, 3)} for v, s in samples.items()]
    table = Table(title=f"One no-op read at a time, caller's clock: {calls} calls per variant, "
                        "interleaved", caption="added: p50 minus the in-process p50")
    for column in ("variant", "p50 ms", "p99 ms", "added p50 ms"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for r in rows:
        table.add_row(str(r["variant"]), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                      f"{r['added_p50_ms']:+.2f}")
    console.print(table)
    payload = {"config": {"calls": calls, "warmup": warmup, "store": "sqlite",
                          "order": "interleaved call by call, rotating"},
               "machine": machine, "summary": rows}
    return save_results("mcp_latency", payload, out_dir, console)


def _listening(url: str, server: WorkerProcess) -> bool:
    server.check_alive()
    try:
        return httpx2.get(url).status_code == 401
    except httpx2.TransportError:
        return False

