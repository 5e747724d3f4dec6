"""One call at a time, by the caller's clock: ``call_tool`` + ``wait`` against Celery's
``apply_async().get()``.

What an agent feels: it requests a tool and waits for the result before the model goes on.
The clock is the caller's (``time.perf_counter`` around the whole request and wait), not the
store's ``created_at`` -> ``finished_at``, which leaves out what ``wait`` adds.

Variants, interleaved call by call (raw, read, single, raw, read, single, ... with the first
variant rotating every round), so drift in the machine's load falls on all of them alike:

* ``raw``: ``apply_async()`` of a no-op Celery task, then ``.get()`` (Redis result backend,
  which wakes the caller by pub/sub when the result lands);
* ``read``: ``call_tool`` of a no-op ``read`` tool, then ``wait``;
* ``single``: the same on the single-attempt path.

The send step (``apply_async`` or ``call_tool``) is timed on its own as well: that is the send
latency in isolation (one call in flight; the throughput benchmark gives it under load).
Workers: the throughput benchmark's (``-c 2`` prefork each, one private Redis).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import raw_tasks
from bench.infra import (
    BenchError,
    bench_session,
    by_variant,
    fresh_store,
    median,
    percentile,
    save_results,
)
from bench.targets import check, print_targets
from bench.throughput import DEX_TOOLS, VARIANTS, WAIT_TIMEOUT, Bench

CALLS_PER_SESSION = 10


@dataclass
class Samples:
    """The timings of one store and variant in one round (seconds)."""

    store: str
    variant: str
    round: int
    total: list[float] = field(default_factory=list)
    send: list[float] = field(default_factory=list)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def one_raw(bench: Bench) -> tuple[float, float]:
    """``apply_async().get()`` of the no-op task: (send, total) seconds."""
    assert bench.raw_app is not None
    task = bench.raw_app.tasks[raw_tasks.NOOP]
    t0 = time.perf_counter()
    result = task.apply_async()
    t1 = time.perf_counter()
    result.get(timeout=WAIT_TIMEOUT)
    t2 = time.perf_counter()
    result.forget()
    return t1 - t0, t2 - t0


def one_dex(bench: Bench, variant: str, session: str, i: int,
            keys: list[str] | None = None) -> tuple[float, float]:
    """``call_tool`` + ``wait`` of a no-op tool: (send, total) seconds (``keys``: the call's
    key is appended to it)."""
    assert bench.client is not None
    client = bench.client
    t0 = time.perf_counter()
    record = client.call_tool(session_id=f"{session}-{i // CALLS_PER_SESSION}", turn_id="t",
                              tool_call_id=f"c{i}", tool=DEX_TOOLS[variant])
    t1 = time.perf_counter()
    if keys is not None:
        keys.append(record.key)
    done = client.wait(record.key, timeout=WAIT_TIMEOUT)
    t2 = time.perf_counter()
    if not done.terminal or done.status.value != "succeeded":
        raise BenchError(f"{variant}: call {record.key} ended {done.status.value}: {done.error}")
    return t1 - t0, t2 - t0


def run_round(bench: Bench, store: str, rnd: int, calls: int, tag: str) -> list[Samples]:
    """``calls`` calls of every variant, one at a time, interleaved."""
    order = list(VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)])
    samples = {v: Samples(store, v, rnd) for v in VARIANTS}
    for i in range(calls):
        for variant in order:
            bench.check_alive() if i % 50 == 0 else None
            try:
                if variant == "raw":
                    send, total = one_raw(bench)
                else:
                    send, total = one_dex(bench, variant, f"{tag}-{variant}-{rnd}", i)
            except TimeoutError as err:
                bench.check_alive()
                raise BenchError(f"{variant}: {err}") from err
            samples[variant].send.append(send)
            samples[variant].total.append(total)
    return [samples[v] for v in VARIANTS]


def run_latency(
    *,
    calls: int,
    rounds: int,
    stores: list[str],
    postgres_url: str | None,
    warmup: int = 20,
    loglevel: str = "WARNING",
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the interleaved rounds on every store; print the table; write the results."""
    if calls < 1 or rounds < 1:
        raise BenchError(f"--calls and --rounds must be at least 1, got {calls} and {rounds}")
    console = console or Console()
    results: list[Samples] = []
    with bench_session("latency", stores, postgres_url) as (redis_server, machine, workdir):
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url, \
                    console.status(f"latency on {kind}: {rounds} x {calls} calls per variant"):
                bench = Bench(redis_server, url, workdir, loglevel)
                try:
                    bench.start()
                    run_round(bench, kind, 0, warmup, "warm")
                    for rnd in range(rounds):
                        results += run_round(bench, kind, rnd, calls, "lat")
                        bench.purge()
                finally:
                    bench.stop()
    rows = aggregate(results)
    targets = latency_targets(rows)
    print_table(console, rows, calls, rounds)
    print_targets(console, targets)
    payload = {
        "config": {"calls": calls, "rounds": rounds, "stores": stores, "warmup": warmup,
                   "order": "interleaved call by call, first variant rotating per round",
                   "clock": "caller's perf_counter around send + wait / get"},
        "machine": machine,
        "summary": rows,
        "rounds": [{"store": s.store, "variant": s.variant, "round": s.round,
                    "total_p50_ms": _ms(median(s.total)), "send_p50_ms": _ms(median(s.send))}
                   for s in results],
        "targets": targets,
    }
    return save_results("latency", payload, out_dir, console)


def aggregate(results: list[Samples]) -> list[dict[str, Any]]:
    """Per store and variant: pooled percentiles, and the median over rounds of the ratio of
    this variant's p50 to raw's p50 in the same round."""
    rows: list[dict[str, Any]] = []
    for store, variant, runs, raw in by_variant(results, VARIANTS, "raw"):
        total = [t for s in runs for t in s.total]
        send = [t for s in runs for t in s.send]
        ratio = [median(s.total) / median(b.total) for s, b in zip(runs, raw, strict=True)]
        send_ratio = [median(s.send) / median(b.send) for s, b in zip(runs, raw, strict=True)]
        rows.append({
            "store": store, "variant": variant, "calls": len(total),
            "total_p50_ms": _ms(percentile(total, 50)),
            "total_p99_ms": _ms(percentile(total, 99)),
            "send_p50_ms": _ms(percentile(send, 50)),
            "send_p99_ms": _ms(percentile(send, 99)),
            "vs_raw": round(median(ratio), 3),
            "send_vs_raw": round(median(send_ratio), 3),
        })
    return rows


def latency_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    raw = {r["store"]: r for r in rows if r["variant"] == "raw"}
    for r in rows:
        if r["variant"] == "raw":
            continue
        base = raw[r["store"]]
        out.append(check("one_at_a_time_vs_raw", r["vs_raw"], f"{r['store']} {r['variant']}",
                         f"{r['total_p50_ms']:.2f} vs {base['total_p50_ms']:.2f} ms p50"))
    return out


def print_table(console: Console, rows: list[dict[str, Any]], calls: int, rounds: int) -> None:
    table = Table(title=f"One call at a time, caller's clock: {calls} calls x {rounds} rounds "
                        "per variant, interleaved",
                  caption="total: send + result in hand (apply_async().get() or call_tool + "
                          "wait); send: apply_async or call_tool alone (isolation). vs raw: "
                          "median over rounds of p50 / raw's p50")
    for column in ("store", "variant", "total p50", "total p99", "vs raw", "send p50",
                   "send p99", "send vs raw"):
        table.add_column(column, justify="left" if column in ("store", "variant") else "right")
    for r in rows:
        table.add_row(r["store"], r["variant"], f"{r['total_p50_ms']:.2f}",
                      f"{r['total_p99_ms']:.2f}", f"{r['vs_raw']:.2f}x",
                      f"{r['send_p50_ms']:.2f}", f"{r['send_p99_ms']:.2f}",
                      f"{r['send_vs_raw']:.2f}x")
    console.print(table)
