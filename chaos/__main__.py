"""``python -m chaos``: run the chaos harness, print its figures, exit 1 on any violation."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from chaos.harness import Config, Report, run
from dex_tasks.states import CallStatus

STATUSES = [s.value for s in (CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.OUTCOME_UNKNOWN,
                              CallStatus.REJECTED)]


def parse(argv: list[str] | None = None) -> tuple[Config, Path | None]:
    """The command line as a :class:`Config` (and where to write the JSON summary)."""
    p = argparse.ArgumentParser(
        prog="python -m chaos",
        description="Mixed tool calls against real workers, beat and Redis while processes are "
                    "SIGKILLed and Redis restarts; then every guarantee is checked.",
    )
    p.add_argument("--calls", type=int, default=2000, help="calls to make (default 2000)")
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--concurrency", type=int, default=2, help="children per worker (default 2)")
    p.add_argument("--same-workers", action="store_true",
                   help="every worker prefork serving every tool (default: a mix of pools "
                        "and tool sets, see chaos.harness.worker_specs)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds over which the calls and faults are spread (default 60)")
    p.add_argument("--child-kills", type=int, help="SIGKILLs of busy children (default: one "
                   "per 3 s of duration)")
    p.add_argument("--worker-kills", type=int, help="SIGKILLs of whole workers (default: one "
                   "per 20 s)")
    p.add_argument("--beat-restarts", type=int, help="beat restarts (default: one per 30 s)")
    p.add_argument("--redis-restarts", type=int, default=1, help="Redis crashes (default 1)")
    p.add_argument("--redis-outage", type=float, default=2.0,
                   help="seconds Redis stays down per crash (default 2)")
    p.add_argument("--store-faults", type=int, default=1,
                   help="store faults: SQLite's write lock held, or PostgreSQL dropping every "
                        "connection, for --store-outage seconds (default 1)")
    p.add_argument("--store-outage", type=float, default=2.0,
                   help="seconds each store fault lasts (default 2)")
    p.add_argument("--database-url", help="store URL; a postgresql+psycopg://... server URL gets "
                   "a fresh database per run (default: SQLite in the run's directory)")
    p.add_argument("--settle-timeout", type=float, default=120.0,
                   help="how long to wait for every call to end after the load (default 120)")
    p.add_argument("--lease", type=float, default=4.0, help="lease seconds (default 4)")
    p.add_argument("--seed", type=int, help="random seed, to repeat a run's plan")
    p.add_argument("--workdir", type=Path, help="directory for logs, ledger and store "
                   "(default: a temporary one, removed after a clean run)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", type=Path, dest="json_path", help="also write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    if a.calls < 1 or a.workers < 1 or a.concurrency < 1 or a.duration <= 0:
        p.error("--calls, --workers, --concurrency and --duration must be positive")
    console = Console(stderr=True)
    config = Config(
        calls=a.calls, workers=a.workers, concurrency=a.concurrency, mixed=not a.same_workers,
        duration=a.duration,
        child_kills=a.child_kills, worker_kills=a.worker_kills, beat_restarts=a.beat_restarts,
        redis_restarts=a.redis_restarts, redis_outage=a.redis_outage,
        store_faults=a.store_faults, store_outage=a.store_outage,
        database_url=a.database_url, settle_timeout=a.settle_timeout, lease_seconds=a.lease,
        seed=a.seed, workdir=a.workdir, keep=a.keep,
        progress=None if a.quiet else (
            lambda m: console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {m}", highlight=False)
        ),
    )
    return config, a.json_path


def render(report: Report, console: Console) -> None:
    """The figures of a run as tables."""
    calls = Table(title="Calls by tool and status", title_justify="left")
    calls.add_column("tool")
    for status in [*STATUSES, "other", "total"]:
        calls.add_column(status, justify="right")
    totals = dict.fromkeys([*STATUSES, "other", "total"], 0)
    for tool, counts in sorted(report.verdict.by_tool.items()):
        row = [counts.get(s, 0) for s in STATUSES]
        other = sum(counts.values()) - sum(row)
        cells = [*row, other, sum(counts.values())]
        for name, cell in zip([*STATUSES, "other", "total"], cells, strict=True):
            totals[name] += cell
        calls.add_row(tool, *map(str, cells))
    calls.add_row("[bold]all", *[f"[bold]{v}" for v in totals.values()])
    console.print(calls)

    f = report.figures
    t = report.timings
    figures = Table(title="Figures", title_justify="left")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    rows: list[tuple[str, object]] = [
        ("calls made / stored", f"{f['driver.calls']} / {f['calls']}"),
        ("call_tool failed at once (Redis down)", f["driver.failed_at_call"]),
        ("tool executions (ledger)", f["executions"]),
        ("  of which repeats of a key (retries, redeliveries)", f["executions.repeated"]),
        ("single-attempt keys executed twice", f["duplicates.single_attempt"]),
        ("did not run (exact prefix)", f["did_not_run"]),
        ("outcome_unknown (each hit by a kill)", f["outcome_unknown"]),
        ("retrying calls out of attempts", f["attempts_ran_out"]),
        ("attempts declared lost (each hit by a kill)", f["attempts_lost"]),
        ("approvals granted by the driver", f["approvals.approved"]),
        ("busy children SIGKILLed", f["kills.child"]),
        ("whole workers SIGKILLed (processes)",
         f"{f['kills.worker']} ({f['kills.worker_processes']})"),
        ("kills skipped (no safe moment)",
         f["faults.child_kill_skipped"] + f["faults.worker_kill_skipped"]),
        ("beat restarts", f["faults.beat"]),
        ("Redis crashes + restarts (down s)",
         f"{f['faults.redis']} ({t.get('redis_downtime', 0):.1f})"),
        ("read latency p50 / p99 (ms)",
         f"{f['latency_ms.read_p50']} / {f['latency_ms.read_p99']}"),
        ("time: start / load / settle / total (s)",
         " / ".join(f"{t.get(k, 0):.1f}" for k in ("start", "load", "settle", "total"))),
        ("violations", len(report.verdict.violations)),
    ]
    for label, value in rows:
        figures.add_row(label, str(value))
    console.print(figures)
    if report.verdict.violations:
        console.print(f"[bold red]{len(report.verdict.violations)} violation(s):")
        for line in report.verdict.violations[:30]:
            console.print(f"  {line}", highlight=False, markup=False)
        console.print(f"logs, ledger and store kept in {report.workdir}")
    else:
        console.print("[bold green]every guarantee held")


def main(argv: list[str] | None = None) -> int:
    """Run, print, and return the exit status (0: every guarantee held)."""
    config, json_path = parse(argv)
    report = run(config)
    render(report, Console())
    if json_path is not None:
        json_path.write_text(json.dumps({
            "ok": report.ok,
            "violations": report.verdict.violations,
            "figures": dict(report.figures),
            "timings": report.timings,
            "by_tool": {k: dict(v) for k, v in report.verdict.by_tool.items()},
        }, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
