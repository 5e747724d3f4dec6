"""``python -m bench workload`` and ``python -m bench gap``: run ``bench.workload``'s plans, print
the tables with the command that made them, and write the JSON results (issue 29)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.infra import BenchError, save_results
from bench.workload import DESIGN, GAP, OLD, PHASES, Plan, Run, run_plan, scaled, summarize

# Issue 29's targets: (figure, comparison, bound).
GOALS = {"throughput": (">=", 0.8), "io": ("<=", 1.2), "one_at_a_time": ("<=", 1.2)}
CPU_GROUPS = ("producer", "worker main", "children", "redis", "database", "total")


def _verdict(kind: str, value: float) -> str:
    op, bound = GOALS[kind]
    met = value >= bound if op == ">=" else value <= bound
    return f"{op} {bound}x: {'met' if met else 'MISSED'}"


def run_workload(*, calls: int | None, rounds: int, stores: list[str],
                 postgres_url: str | None, warmup: int, latency_calls: int,
                 io_calls: int | None, io_seconds: float, io_concurrency: int, io_rounds: int,
                 with_old: bool, command: str, out_dir: Path | None = None,
                 console: Console | None = None) -> dict[str, Any]:
    """DESIGN's workload (and the old benchmark's shape beside it) on every store."""
    if rounds < 1 or warmup < 1 or latency_calls < 0 or io_rounds < 1:
        raise BenchError("--rounds, --warmup and --io-rounds must be at least 1, "
                         "--latency-calls not negative")
    console = console or Console()
    design = scaled(DESIGN, calls)
    shapes = [design, scaled(OLD, calls and max(1, calls // 4))] if with_old else [design]
    io_shape = scaled(DESIGN, io_calls or 1000)
    plan = Plan(shapes, rounds, warmup, latency_calls, io_shape, io_seconds, io_concurrency,
                io_rounds)
    done = run_plan(plan, stores, postgres_url, lambda s: console.log(s))
    rows = summarize(done["runs"])
    console.print(f"[bold]{command}[/bold]")
    print_throughput(console, rows, "DESIGN's workload (version 4) beside the old benchmark's")
    print_cpu(console, rows)
    print_one(console, done["one_at_a_time"])
    print_io(console, done["io"])
    print_statements(console, done["statements"])
    payload = {"command": command, "machine": done["machine"],
               "config": {"shapes": [asdict(s) | {"describe": s.describe()} for s in shapes],
                          "rounds": rounds, "warmup": warmup, "latency_calls": latency_calls,
                          "io": asdict(io_shape), "io_seconds": io_seconds,
                          "io_concurrency": io_concurrency, "io_rounds": io_rounds,
                          "workers": "prefork -c 2 -l warning each; I/O: --pool threads",
                          "stores": stores},
               "throughput": rows, "one_at_a_time": done["one_at_a_time"], "io": done["io"],
               "statements": done["statements"], "runs": [_run(r) for r in done["runs"]]}
    return save_results("workload", payload, out_dir, console)


def run_gap(*, calls: int | None, rounds: int, stores: list[str], postgres_url: str | None,
            warmup: int, command: str, out_dir: Path | None = None,
            console: Console | None = None) -> dict[str, Any]:
    """The old shape, one factor of DESIGN's at a time, and DESIGN's shape: the ratios."""
    if rounds < 1 or warmup < 1:
        raise BenchError("--rounds and --warmup must be at least 1")
    console = console or Console()
    factor = (calls / DESIGN.calls) if calls else 1.0
    shapes = [scaled(s, max(1, round(s.calls * factor))) if calls else s for s in GAP]
    done = run_plan(Plan(shapes, rounds, warmup), stores, postgres_url, lambda s: console.log(s))
    rows = summarize(done["runs"])
    console.print(f"[bold]{command}[/bold]")
    print_throughput(console, rows, "From the old benchmark's shape to DESIGN's, one factor at "
                                    "a time", {s.name: s.describe() for s in shapes})
    print_cpu(console, rows)
    payload = {"command": command, "machine": done["machine"],
               "config": {"shapes": [asdict(s) | {"describe": s.describe()} for s in shapes],
                          "rounds": rounds, "warmup": warmup, "stores": stores},
               "throughput": rows, "runs": [_run(r) for r in done["runs"]]}
    return save_results("gap", payload, out_dir, console)


def _run(r: Run) -> dict[str, Any]:
    return {"store": r.store, "shape": r.shape, "variant": r.variant, "round": r.round,
            "calls": r.calls, "elapsed_s": round(r.elapsed, 3), "calls_per_s": round(r.rate, 1),
            "cpu_s": {k: round(v, 3) for k, v in r.cpu.items()}, "failures": r.failures}


def print_throughput(console: Console, rows: list[dict[str, Any]], title: str,
                     shapes: dict[str, str] | None = None) -> None:
    table = Table(title=f"No-op read calls/s: {title}",
                  caption="calls/s: median of the rounds; vs raw: median of the rounds' "
                          "ratios (raw and dex alternate round by round)")
    for column in ("store", "shape", "calls", "dex calls/s", "Celery calls/s", "vs raw",
                   "rounds", "target", "failed"):
        table.add_column(column, justify="left" if column in ("store", "shape") else "right")
    for r in rows:
        table.add_row(r["store"], r["shape"] + (f" ({shapes[r['shape']]})" if shapes else ""),
                      str(r["calls"]), f"{r['dex_calls_per_s']:.0f}",
                      f"{r['raw_calls_per_s']:.0f}", f"{r['vs_raw']:.2f}x",
                      " ".join(f"{x:.2f}" for x in r["vs_raw_rounds"]),
                      _verdict("throughput", r["vs_raw"]), str(r["failures"]))
    console.print(table)


def print_cpu(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="CPU per call by process, µs (user + system, /proc/<pid>/stat deltas "
                        "over each round, median of the rounds)",
                  caption="database: the private PostgreSQL server and its backends (SQLite "
                          "runs inside the producer and the children)")
    for column in ("store", "shape", "side", *CPU_GROUPS):
        table.add_column(column, justify="left" if column in ("store", "shape", "side")
                         else "right")
    for r in rows:
        for side, name in (("dex", "dex-tasks"), ("raw", "Celery")):
            cpu = r[f"{side}_cpu_us_per_call"]
            table.add_row(r["store"], r["shape"], name,
                          *(f"{cpu[g]:.0f}" if g in cpu else "-" for g in CPU_GROUPS))
    console.print(table)


def print_one(console: Console, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    table = Table(title="One call at a time: call_tool + wait vs apply_async().get(), caller's "
                        "clock, interleaved")
    for column in ("store", "calls", "dex p50 ms", "Celery p50 ms", "vs raw", "dex p99 ms",
                   "Celery p99 ms", "target"):
        table.add_column(column, justify="left" if column == "store" else "right")
    for r in rows:
        table.add_row(r["store"], str(r["calls"]), f"{r['dex_p50_ms']:.2f}",
                      f"{r['raw_p50_ms']:.2f}", f"{r['vs_raw']:.2f}x", f"{r['dex_p99_ms']:.2f}",
                      f"{r['raw_p99_ms']:.2f}", _verdict("one_at_a_time", r["vs_raw"]))
    console.print(table)
    table = Table(title="One call at a time: where a dex-tasks call's time goes, p50 ms "
                        "of each phase")
    table.add_column("store")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    for r in rows:
        table.add_row(r["store"], *(f"{r['phases_p50_ms'][p]:.2f}" for p in PHASES))
    console.print(table)
    console.print("call_tool: the insert and the publish; to the worker: until its child starts "
                  "the attempt; in the worker: the call's read, its lease, the tool; back: the "
                  "ending's commit, the announcement, the wake-up and the waiter's read",
                  justify="center")


def print_statements(console: Console, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    table = Table(title="PostgreSQL per dex-tasks call of DESIGN's rounds, by statement "
                        "(pg_stat_statements on the private server)")
    for column in ("runs per call", "exec µs per call", "WAL bytes per call", "statement"):
        table.add_column(column, justify="left" if column == "statement" else "right")
    for r in rows:
        table.add_row(f"{r['per_call']:.2f}", f"{r['exec_us_per_call']:.1f}",
                      str(r["wal_bytes_per_call"]), r["statement"])
    console.print(table)
    console.print("exec: the executor's time alone (no parse, network or commit, which the "
                  "database's CPU above includes)", justify="center")


def print_io(console: Console, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    table = Table(title="The I/O burst: one-second I/O calls on --pool threads, first send to "
                        "last result seen",
                  caption="dex polled: get_tool_call every 20 ms until terminal (DESIGN); dex "
                          "wait: wait on each (the old benchmark); Celery: ready() every 20 ms")
    for column in ("store", "calls", "-c", "Celery s", "dex polled s", "vs raw",
                   "dex wait s", "vs raw (wait)", "target"):
        table.add_column(column, justify="left" if column == "store" else "right")
    for r in rows:
        wall, ratio = r["wall_s"], r["vs_raw"]
        table.add_row(r["store"], str(r["calls"]), str(r["concurrency"]), f"{wall['raw']:.2f}",
                      f"{wall['dex polled']:.2f}", f"{ratio['dex polled']:.2f}x",
                      f"{wall['dex wait']:.2f}", f"{ratio['dex wait']:.2f}x",
                      _verdict("io", ratio["dex polled"]))
    console.print(table)
