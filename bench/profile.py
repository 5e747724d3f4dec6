"""Where the producer's time goes: ``call_tool`` (and a burst through ``call_tools``) under
cProfile, set beside Celery's ``apply_async`` of a no-op task on the same Redis.

``python -m bench profile [--store sqlite|postgres|both] [--calls N]``. No worker runs: the
calls stay queued, which is all the producer sees. The tools' catalog is published by a
subprocess, as a worker would, so this process looks its tools up like an agent does. The
summary lists the functions with the most time of their own, and the share of the whole that
the store, Redis (kombu, redis-py) and dex-tasks' own Python take. Beside them: the p50 of the
store write alone (``Store.insert_call``) and, on PostgreSQL, of one durable commit of a trivial
row, the floor any durable write of a call stands on.
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import raw_tasks
from bench.driver import REQUESTED, call_row
from bench.infra import READ_TOOL, RedisServer, fresh_store, median, save_results
from bench.roundtrips import publish_catalog
from bench.targets import check, print_targets
from dex_tasks import DexClient, DexSettings

DEX_DB, RAW_DB = 6, 7  # (and RAW_DB + 1, the raw result backend)
# Where a function's own time is counted, by the path of its file.
_AREAS = (("store", ("sqlalchemy", "psycopg", "sqlite3", "dex_tasks/store")),
          ("redis", ("kombu", "redis/", "celery")),
          ("dex-tasks", ("dex_tasks",)))


def _area(filename: str) -> str:
    for area, marks in _AREAS:
        if any(mark in filename for mark in marks):
            return area
    return "other"


def _summary(profile: cProfile.Profile, calls: int, top: int) -> dict[str, Any]:
    stats = pstats.Stats(profile)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1e-9
    areas: dict[str, float] = {}
    for (filename, _, _), v in raw.items():
        areas[_area(filename)] = areas.get(_area(filename), 0.0) + v[2]
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {
        "areas": {k: round(v / total, 3) for k, v in sorted(areas.items())},
        "top": [{"function": f"{Path(fn).name}:{line} {name}",
                 "own_us_per_call": round(v[2] / calls * 1e6, 1), "ncalls": v[1]}
                for (fn, line, name), v in ranked],
    }


def _timed(fn: Any, calls: int) -> list[float]:
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return times


def run_profile(*, stores: list[str], postgres_url: str | None, calls: int, top: int,
                console: Console, out_dir: Path | None = None) -> dict[str, Any]:
    """Profile ``call_tool`` and ``call_tools`` on each store; print and return the summary."""
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        redis_server = RedisServer().start()
        stack.callback(redis_server.stop)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dex-prof-")))
        noop = raw_tasks.create_app(redis_server.url(RAW_DB),
                                    redis_server.url(RAW_DB + 1)).tasks[raw_tasks.NOOP]
        for _ in range(20):
            noop.apply_async()
        raw_p50 = median(_timed(lambda i: noop.apply_async(), calls))
        for kind in stores:
            url = stack.enter_context(fresh_store(kind, postgres_url, workdir))
            publish_catalog(url)
            client = DexClient(DexSettings(redis_url=redis_server.url(DEX_DB), database_url=url),
                               create_tables=False)
            stack.callback(client.close)

            def one(i: int, kind: str = kind, client: DexClient = client) -> None:
                client.call_tool(session_id=f"p-{kind}-{i // 10}", turn_id="t",
                                 tool_call_id=f"c{i}", tool=READ_TOOL)

            for i in range(20):
                client.call_tool(session_id=f"w-{kind}", turn_id="t", tool_call_id=f"w{i}",
                                 tool=READ_TOOL)
            p50 = median(_timed(lambda i, one=one: one(i + calls), calls))
            # What holds call_tool back: its store write alone (the call and its first event,
            # one durable commit), and on PostgreSQL one durable commit of a trivial row.
            insert_p50 = median(_timed(lambda i, c=client, k=kind: c.store.insert_call(
                call_row(f"i-{k}-{i // 10}/t/c{i}", time.time()), requested=REQUESTED), calls))
            floor_p50 = _durable_commit_p50(client, calls) if kind == "postgres" else None
            profile = cProfile.Profile()
            profile.enable()
            for i in range(calls):
                one(i)
            profile.disable()
            burst = [{"tool": READ_TOOL, "tool_call_id": f"b{i}"} for i in range(calls)]
            t0 = time.perf_counter()
            client.call_tools(burst, session_id=f"burst-{kind}", turn_id="t")
            burst_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(calls):
                noop.apply_async()
            raw_burst_s = time.perf_counter() - t0
            results[kind] = {"call_tool_p50_ms": round(p50 * 1000, 3),
                             "apply_async_p50_ms": round(raw_p50 * 1000, 3),
                             "ratio": round(p50 / raw_p50, 3),
                             "insert_call_p50_ms": round(insert_p50 * 1000, 3),
                             "durable_commit_p50_ms": (round(floor_p50 * 1000, 3)
                                                       if floor_p50 is not None else None),
                             "burst_call_tools_s": round(burst_s, 3),
                             "burst_apply_async_s": round(raw_burst_s, 3),
                             **_summary(profile, calls, top)}
    _print(console, results, calls)
    targets = [check("call_tool_alone_vs_apply_async", r["ratio"], kind,
                     f"{r['call_tool_p50_ms']:.2f} vs {r['apply_async_p50_ms']:.2f} ms")
               for kind, r in results.items()]
    targets += [check("burst_send_vs_raw", r["burst_call_tools_s"] / r["burst_apply_async_s"],
                      kind, f"{calls} calls: {r['burst_call_tools_s']:.2f} vs "
                            f"{r['burst_apply_async_s']:.2f} s")
                for kind, r in results.items()]
    print_targets(console, targets)
    return save_results("profile", {"config": {"calls": calls, "stores": stores},
                                    "stores": results, "targets": targets}, out_dir, console)


def _durable_commit_p50(client: DexClient, calls: int) -> float:
    """PostgreSQL: the p50 of one autocommit INSERT of a trivial row on the DB-API
    connection, ``synchronous_commit`` on: the least any durable write of a call costs."""
    raw = client.store.engine.raw_connection()
    try:
        driver: Any = raw.driver_connection
        driver.autocommit = True
        driver.execute("CREATE TABLE IF NOT EXISTS bench_commit_floor (k text primary key)")
        times = _timed(lambda i: driver.execute(
            "INSERT INTO bench_commit_floor VALUES (%s)", (f"k{i}",)), calls)
        driver.execute("DROP TABLE bench_commit_floor")
        return median(times)
    finally:
        raw.close()


def _print(console: Console, results: dict[str, Any], calls: int) -> None:
    for kind, r in results.items():
        floor = (f", one durable commit of a trivial row {r['durable_commit_p50_ms']} ms"
                 if r["durable_commit_p50_ms"] is not None else "")
        console.print(
            f"[bold]{kind}[/bold]: call_tool p50 {r['call_tool_p50_ms']} ms vs apply_async "
            f"{r['apply_async_p50_ms']} ms ({r['ratio']}x); its store write alone "
            f"(Store.insert_call) {r['insert_call_p50_ms']} ms{floor}; {calls} calls in one "
            "call_tools "
            f"{r['burst_call_tools_s']} s vs {calls} apply_async {r['burst_apply_async_s']} s; "
            "own time by area: " + ", ".join(f"{k} {v:.0%}" for k, v in r["areas"].items()))
        table = Table(title=f"call_tool under cProfile, {kind}: most time of their own")
        for column in ("function", "µs per call_tool", "calls"):
            table.add_column(column)
        for row in r["top"]:
            table.add_row(row["function"], f"{row['own_us_per_call']:g}", str(row["ncalls"]))
        console.print(table)
