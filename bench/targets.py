"""The targets of issues 6, 11 and 12, set beside measured figures: pass or miss, reported,
never asserted."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Target:
    """One target: ``measured <op> bound`` passes."""

    id: str
    text: str
    op: str
    bound: float
    unit: str

    def passes(self, value: float) -> bool:
        compare: Callable[[float, float], bool] = {
            ">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt,
        }[self.op]
        return compare(value, self.bound)


TARGETS: dict[str, Target] = {t.id: t for t in (
    # Issue 12 (performance).
    Target("read_vs_raw_sqlite", "dex read throughput vs raw Celery (SQLite)", ">=", 1.0, "x"),
    Target("read_vs_raw_postgres", "dex read throughput vs raw Celery (PostgreSQL)", ">=", 0.8,
           "x"),
    Target("single_vs_read", "single-attempt throughput vs dex read", ">=", 0.9, "x"),
    Target("call_tool_vs_apply_async_p50", "call_tool p50 under load vs apply_async p50", "<=",
           1.5, "x"),
    Target("one_at_a_time_vs_raw", "one call at a time, call to result in hand, vs "
           "apply_async().get() (p50)", "<=", 1.2, "x"),
    # Issue 20: call_tool alone within 1.5x apply_async, and a burst from one agent process
    # leaves as fast as Celery's.
    Target("call_tool_alone_vs_apply_async", "call_tool p50 vs apply_async p50, one at a "
           "time, no worker running", "<=", 1.5, "x"),
    Target("burst_send_vs_raw", "calls sent from one process: call_tools (one turn) vs as "
           "many apply_async", "<=", 1.2, "x"),
    Target("io_wall_vs_raw", "one-second I/O calls, threads pool: wall time vs Celery",
           "<=", 1.2, "x"),
    Target("io_rss", "one-second I/O calls, threads pool: dex-tasks worker peak RSS", "<",
           500.0, "MB"),
    # Issue 11 item 15: a scrape's cost follows the open calls, not the ended ones.
    Target("scrape_growth", "/metrics scrape time, most ended calls vs none", "<", 2.0, "x"),
    # Issue 6.
    Target("sweep_growth", "deadline sweep time, largest vs smallest scale", "<", 2.0, "x"),
    Target("rss_growth", "worker RSS growth per 100k calls", "<", 10.0, "MB"),
)}


# The command that measures each target on its own (``make bench`` runs them all).
COMMANDS: dict[str, str] = {
    "read_vs_raw_sqlite": "python -m bench throughput --store sqlite",
    "read_vs_raw_postgres": "python -m bench throughput --store postgres",
    "single_vs_read": "python -m bench throughput",
    "call_tool_vs_apply_async_p50": "python -m bench throughput",
    "one_at_a_time_vs_raw": "python -m bench latency",
    "call_tool_alone_vs_apply_async": "python -m bench profile",
    "burst_send_vs_raw": "python -m bench profile",
    "io_wall_vs_raw": "python -m bench io --calls 1000",
    "io_rss": "python -m bench io",
    "scrape_growth": "python -m bench scrape",
    "sweep_growth": "python -m bench sweeps",
    "rss_growth": "python -m bench memory",
}


def check(target_id: str, value: float, label: str, note: str = "") -> dict[str, Any]:
    """One row of the targets table (and of the JSON results)."""
    target = TARGETS[target_id]
    ok = value == value and target.passes(value)  # NaN (nothing measured) is a miss
    return {
        "target": target.id,
        "text": target.text,
        "goal": f"{target.op} {target.bound:g}{target.unit}",
        "label": label,
        "measured": round(value, 3) if value == value else None,
        "unit": target.unit,
        "pass": ok,
        "note": note,
    }


def print_targets(console: Console, rows: list[dict[str, Any]], title: str = "") -> None:
    """The targets table: goal, what was measured (and on which store / scale), pass or miss."""
    table = Table(title=title or "Targets (reported, not asserted)")
    for column in ("target", "where", "goal", "measured", "result", "note", "command"):
        table.add_column(column, justify="right" if column == "measured" else "left")
    for row in rows:
        measured = "-" if row["measured"] is None else f"{row['measured']:g}{row['unit']}"
        result = "[green]pass[/green]" if row["pass"] else "[red]miss[/red]"
        table.add_row(row["text"], row["label"], row["goal"], measured, result, row["note"],
                      COMMANDS.get(row["target"], ""))
    console.print(table)
