"""A turn of parallel calls: ``call_tools`` of 5 calls against 5 ``call_tool``s, by the caller's
clock.

A model often requests several tools in one turn. Two variants, interleaved turn by turn (the
first one rotating every round), on the throughput benchmark's dex-tasks worker (``-c 2``):

* ``call_tools``: one ``call_tools([...5 no-op reads...])`` (one transaction, one Redis round
  trip), then ``wait`` on each;
* ``call_tool x5``: five ``call_tool`` in a row (five transactions, five publishes), then
  ``wait`` on each.

Figures: the send step (all five recorded and published) and the whole turn (all five results
in hand), p50/p99, and the ratio of the p50s (median over rounds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.infra import (
    READ_TOOL,
    BenchError,
    bench_session,
    by_variant,
    fresh_store,
    median,
    percentile,
    save_results,
)
from bench.throughput import WAIT_TIMEOUT, Bench
from dex_tasks import CallStatus, DexClient, ToolCallRequest

VARIANTS = ("call_tools", "call_tool x5")
CALLS_PER_TURN = 5


@dataclass
class Turns:
    """One store and variant in one round: per turn, the send and total times (seconds)."""

    store: str
    variant: str
    round: int
    send: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)


def one_turn(client: DexClient, variant: str, session: str) -> tuple[float, float]:
    """One turn of five no-op reads: (send, total) seconds by the caller's clock."""
    requests = [ToolCallRequest(tool_call_id=f"c{i}", tool=READ_TOOL)
                for i in range(CALLS_PER_TURN)]
    t0 = time.perf_counter()
    if variant == "call_tools":
        keys = [r.key for r in client.call_tools(requests, session_id=session, turn_id="t")]
    else:
        keys = [client.call_tool(session_id=session, turn_id="t", tool_call_id=r.tool_call_id,
                                 tool=r.tool).key for r in requests]
    t1 = time.perf_counter()
    for key in keys:
        done = client.wait(key, timeout=WAIT_TIMEOUT)
        if done.status is not CallStatus.SUCCEEDED:
            raise BenchError(f"{variant}: call {key} ended {done.status.value}: {done.error}")
    return t1 - t0, time.perf_counter() - t0


def run_batch(
    *,
    turns: int,
    rounds: int,
    stores: list[str],
    postgres_url: str | None,
    warmup: int = 10,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the interleaved turns on every store; print the table; write the results."""
    if turns < 1 or rounds < 1:
        raise BenchError(f"--turns and --rounds must be at least 1, got {turns} and {rounds}")
    console = console or Console()
    results: list[Turns] = []
    with bench_session("batch", stores, postgres_url) as (redis_server, machine, workdir):
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url, \
                    console.status(f"turns on {kind}: {rounds} x {turns} per variant"):
                bench = Bench(redis_server, url, workdir, "WARNING")
                try:
                    bench.start()
                    assert bench.client is not None
                    for i in range(warmup):
                        for variant in VARIANTS:
                            one_turn(bench.client, variant, f"warm-{variant}-{i}")
                    for rnd in range(rounds):
                        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
                        runs = {v: Turns(kind, v, rnd) for v in VARIANTS}
                        for i in range(turns):
                            bench.check_alive() if i % 20 == 0 else None
                            for variant in order:
                                send, total = one_turn(bench.client, variant,
                                                       f"b{rnd}-{i}-{variant[-2:]}")
                                runs[variant].send.append(send)
                                runs[variant].total.append(total)
                        results += [runs[v] for v in VARIANTS]
                        bench.purge()
                except TimeoutError as err:
                    bench.check_alive()
                    raise BenchError(str(err)) from err
                finally:
                    bench.stop()
    rows = aggregate(results)
    print_table(console, rows, turns, rounds)
    payload = {
        "config": {"turns": turns, "rounds": rounds, "calls_per_turn": CALLS_PER_TURN,
                   "stores": stores, "warmup": warmup, "tool": READ_TOOL},
        "machine": machine,
        "summary": rows,
        "targets": [],
    }
    return save_results("batch", payload, out_dir, console)


def aggregate(results: list[Turns]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for store, variant, runs, base in by_variant(results, VARIANTS, VARIANTS[1]):
        send = [s for t in runs for s in t.send]
        total = [s for t in runs for s in t.total]
        rows.append({
            "store": store, "variant": variant, "turns": len(send),
            "send_p50_ms": _ms(percentile(send, 50)),
            "send_p99_ms": _ms(percentile(send, 99)),
            "total_p50_ms": _ms(percentile(total, 50)),
            "total_p99_ms": _ms(percentile(total, 99)),
            "send_vs_single": round(median(
                [median(t.send) / median(b.send) for t, b in zip(runs, base, strict=True)]), 3),
            "total_vs_single": round(median(
                [median(t.total) / median(b.total) for t, b in zip(runs, base, strict=True)]), 3),
        })
    return rows


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def print_table(console: Console, rows: list[dict[str, Any]], turns: int, rounds: int) -> None:
    table = Table(title=f"A turn of {CALLS_PER_TURN} parallel no-op reads: {turns} turns x "
                        f"{rounds} rounds per variant, interleaved",
                  caption="send: all five recorded and published; turn: all five results in "
                          "hand (send + wait on each). vs x5: median over rounds of p50 / the "
                          "five-call_tool p50")
    for column in ("store", "variant", "send p50", "send p99", "send vs x5", "turn p50",
                   "turn p99", "turn vs x5"):
        table.add_column(column, justify="left" if column in ("store", "variant") else "right")
    for r in rows:
        table.add_row(r["store"], r["variant"], f"{r['send_p50_ms']:.2f}",
                      f"{r['send_p99_ms']:.2f}", f"{r['send_vs_single']:.2f}x",
                      f"{r['total_p50_ms']:.2f}", f"{r['total_p99_ms']:.2f}",
                      f"{r['total_vs_single']:.2f}x")
    console.print(table)
