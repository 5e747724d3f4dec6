"""What OpenTelemetry's hooks cost ``call_tool`` (issue 31 item 3): ``python -m bench tracing``.

Three variants of the same agent process, each a fresh child process, interleaved round by
round (the first one rotating), on one private ``redis-server`` and a fresh SQLite store each:

* ``not installed``: ``import opentelemetry`` fails in the child (what a plain install sees);
* ``not configured``: OpenTelemetry installed, no tracer provider set (the hooks look and do
  nothing): the case that must cost nothing;
* ``configured``: an SDK ``TracerProvider`` with no exporter, so the figure is the spans' own
  cost (creating the ``call_tool`` span, its context in the row and the message header), not
  an exporter's.

Each child registers a no-op ``read`` tool in its own process (no worker: the messages wait in
Redis, which call_tool does not), makes ``--warmup`` calls, then ``--calls`` timed calls of
``call_tool`` by the caller's clock. Figures: p50/p99 per variant (median over rounds), the
p50's difference from ``not installed`` (on a shared machine mostly the store's fsync noise),
and the hooks alone timed in a loop (what tracing adds to each call_tool, measured apart from
that noise).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.infra import RedisServer, child_env, percentile

VARIANTS = ("not installed", "not configured", "configured")

COMMAND = "python -m bench tracing"


def run(calls: int = 2000, rounds: int = 3, warmup: int = 200,
        console: Console | None = None) -> dict[str, Any]:
    """Run the rounds and print the table; returns the figures."""
    console = console or Console()
    redis_server = RedisServer().start()
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    try:
        for r in range(rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for i, variant in enumerate(order):
                with tempfile.TemporaryDirectory(prefix="dex-bench-trace-") as tmp:
                    db = 1 + (r * 3 + i) % 15
                    redis_server.client(db).flushdb()
                    out = subprocess.run(
                        [sys.executable, "-m", "bench.tracing_cost", variant,
                         redis_server.url(db), f"sqlite:///{Path(tmp) / 'dex.db'}",
                         str(calls), str(warmup)],
                        env=child_env({}), capture_output=True, text=True, timeout=900)
                    if out.returncode != 0:
                        raise RuntimeError(f"{variant}: {out.stderr[-2000:]}")
                    results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        redis_server.stop()
    figures = {v: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "hooks_ns")}
               for v, rs in results.items()}
    base = figures["not installed"]["p50"]
    table = Table(title=f"call_tool with OpenTelemetry's hooks: {calls} calls x {rounds} rounds"
                        f" ({COMMAND} --calls {calls} --rounds {rounds})")
    for column in ("variant", "p50 µs", "p99 µs", "p50 vs not installed",
                   "the hooks alone, per call"):
        table.add_column(column)
    for variant in VARIANTS:
        f = figures[variant]
        table.add_row(variant, f"{f['p50']:.0f}", f"{f['p99']:.0f}",
                      f"{f['p50'] - base:+.0f} µs ({(f['p50'] / base - 1) * 100:+.1f}%)",
                      f"{f['hooks_ns'] / 1000:.2f} µs")
    console.print(table)
    return {"calls": calls, "rounds": rounds, "figures": figures, "command": COMMAND}


def _child(variant: str, redis_url: str, database_url: str, calls: int, warmup: int) -> None:
    if variant == "not installed":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # import fails
    import bench.noop_tools  # noqa: F401 - registers the no-op read in this process
    from bench.infra import READ_TOOL
    from dex_tasks import DexClient
    from dex_tasks.settings import DexSettings

    if variant == "configured":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())

    settings = DexSettings(redis_url=redis_url, database_url=database_url,
                           secret_key="bench-secret")
    timings: list[float] = []
    with DexClient(settings) as client:
        for i in range(warmup + calls):
            started = time.perf_counter()
            client.call_tool(session_id=f"s{i % 20}", turn_id=f"t{i // 20}",
                             tool_call_id="c", tool=READ_TOOL)
            if i >= warmup:
                timings.append((time.perf_counter() - started) * 1e6)
        if variant == "configured":
            stored = client.store.get_call("s0/t0/c")
            assert stored is not None and stored.trace_context, "configured but not traced"
        else:
            stored = client.store.get_call("s0/t0/c")
            assert stored is not None and stored.trace_context is None
    print(json.dumps({"p50": percentile(timings, 50), "p99": percentile(timings, 99),
                      "hooks_ns": _hooks_ns(stored)}))


def _hooks_ns(row: Any, n: int = 100_000) -> float:
    """What the hooks alone cost one call_tool, in ns: the request's context, the call's span
    (and its traceparent for the row), the message's headers; by the same clock, n times."""
    from dex_tasks import tracing

    started = time.perf_counter_ns()
    for _ in range(n):
        with tracing.requesting():
            tracing.request_span("s/t/c", "s", "t", "c", "bench_noop_read", "read", False)
        tracing.message_headers(row)
    return (time.perf_counter_ns() - started) / n


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
