"""/metrics scrape cost against the number of ended calls in the store (issue 11, item 15).

For each store and each number of ended calls (0 and the scales), a fresh database holds
``open`` open calls (queued, running, awaiting approval) and that many ended ones, bulk-loaded
(``executemany`` on SQLite, ``COPY`` on PostgreSQL, then ``ANALYZE`` on PostgreSQL as autovacuum
would). Then full scrapes (``render_metrics``: the store's open-call gauges plus the Redis
counters) are timed on the databases in turn, ``repeats`` rounds, and so, for comparison, is the
query a scrape ran before the counters: a ``GROUP BY`` over every call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select, text

from bench.infra import (
    BenchError,
    bench_session,
    fresh_store,
    median,
    percentile,
    save_results,
)
from bench.sweep_scale import bulk_insert
from bench.targets import check, print_targets
from dex_tasks.broker.metrics import render_metrics
from dex_tasks.store import CALLS, Store

ENDED = ("succeeded", "failed", "rejected", "outcome_unknown")
OPEN = ("queued", "running", "awaiting_approval")
TOOLS = 12


def _calls(start: int, stop: int, statuses: tuple[str, ...], prefix: str,
           now: float) -> Iterator[dict[str, Any]]:
    for i in range(start, stop):
        status = statuses[i % len(statuses)]
        yield {"key": f"{prefix}{i // 10}/t/c{i}", "session_id": f"{prefix}{i // 10}",
               "turn_id": "t", "tool_call_id": f"c{i}", "tool": f"tool_{i % TOOLS}",
               "arguments": "{}", "effect": "read", "requires_approval": False,
               "max_attempts": 3, "status": status, "attempts": 1, "created_at": now - 60,
               "updated_at": now - 30, "finished_at": now - 30 if status in ENDED else None}


def _old_scan() -> Any:
    """What a scrape ran before counters: every call counted by tool, effect and status."""
    return (select(CALLS.c.tool, CALLS.c.effect, CALLS.c.status, func.count())
            .group_by(CALLS.c.tool, CALLS.c.effect, CALLS.c.status))


def _time(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _old(store: Store) -> None:
    with store.read() as conn:
        conn.execute(_old_scan()).all()


def run_scrape(
    *,
    scales: list[int],
    open_calls: int,
    repeats: int,
    stores: list[str],
    postgres_url: str | None,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Time scrapes at each number of ended calls on every store; print; write the results."""
    if open_calls < 0 or repeats < 1:
        raise BenchError(f"--open must be >= 0 and --repeats >= 1, got {open_calls}, {repeats}")
    console = console or Console()
    rows: list[dict[str, Any]] = []
    now = time.time()
    levels = sorted({0, *scales})
    with bench_session("scrape", stores, postgres_url) as (redis_server, machine, workdir):
        for kind in stores:
            with ExitStack() as stack:
                counters = redis.Redis.from_url(redis_server.url(0))
                stack.callback(counters.close)
                # One database per number of ended calls, all loaded first, then scraped in
                # turn (0, 100k, 500k, 0, 100k, ...), so the machine's load falls on each alike.
                dbs: list[Store] = []
                for level in levels:
                    url = stack.enter_context(fresh_store(kind, postgres_url, workdir))
                    store = Store(url)
                    stack.callback(store.close)
                    store.create_all()
                    with console.status(f"{kind}: loading {level:,} ended calls"):
                        bulk_insert(store, CALLS, _calls(0, open_calls, OPEN, "open", now))
                        bulk_insert(store, CALLS, _calls(0, level, ENDED, "e", now))
                        if not store.is_sqlite:
                            with store.write() as conn:
                                conn.execute(text(f"ANALYZE {CALLS.name}"))
                    for _ in range(3):  # warm the connection pool and the caches
                        render_metrics(store, counters)
                    dbs.append(store)
                scrapes: list[list[float]] = [[] for _ in levels]
                scans: list[list[float]] = [[] for _ in levels]
                with console.status(f"{kind}: timing {repeats} scrapes per level"):
                    for i in range(repeats):
                        for n, store in enumerate(dbs):
                            scrapes[n].append(
                                _time(lambda s=store, c=counters: render_metrics(s, c)))
                            if i < 5:
                                scans[n].append(_time(lambda s=store: _old(s)))
                for n, level in enumerate(levels):
                    rows.append({"store": kind, "ended": level, "open": open_calls,
                                 "scrape_ms": round(median(scrapes[n]) * 1000, 3),
                                 "scrape_p90_ms": round(percentile(scrapes[n], 90) * 1000, 3),
                                 "old_scan_ms": round(median(scans[n]) * 1000, 3)})
    targets = []
    for kind in stores:
        mine = [r for r in rows if r["store"] == kind]
        low, high = mine[0], mine[-1]
        targets.append(check("scrape_growth", high["scrape_ms"] / low["scrape_ms"],
                             f"{kind} {high['ended']:,}/{low['ended']:,} ended",
                             f"{high['scrape_ms']:.1f} vs {low['scrape_ms']:.1f} ms; the old "
                             f"whole-table scan: {high['old_scan_ms']:.0f} ms"))
    print_table(console, rows, repeats)
    print_targets(console, targets)
    payload = {"config": {"scales": scales, "open": open_calls, "repeats": repeats,
                          "stores": stores},
               "machine": machine, "timings": rows, "targets": targets}
    return save_results("scrape", payload, out_dir, console)


def print_table(console: Console, rows: list[dict[str, Any]], repeats: int) -> None:
    table = Table(title="/metrics scrape time against the ended calls in the store",
                  caption=f"median of {repeats} scrapes; old scan: the whole-table GROUP BY "
                          "a scrape ran before the counters, for comparison")
    for column in ("store", "ended calls", "open calls", "scrape ms", "old scan ms"):
        table.add_column(column, justify="left" if column == "store" else "right")
    for r in rows:
        table.add_row(r["store"], f"{r['ended']:,}", f"{r['open']:,}", f"{r['scrape_ms']:.2f}",
                      f"{r['old_scan_ms']:.1f}")
    console.print(table)
