"""``python -m bench``: the benchmarks of issues 6, 11 and 12 (see ``bench/__init__.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from bench.infra import POSTGRES_ENV, BenchError, parse_stores, postgres_admin_url

app = typer.Typer(help=__doc__, no_args_is_help=True, pretty_exceptions_enable=False)
# Wide enough for the tables when the output is a file or a pipe (rich assumes 80 columns).
console = Console(width=max(Console().width, 140))

STORE_HELP = "sqlite, postgres or both (postgres needs --postgres-url or $" + POSTGRES_ENV + ")."
PG_HELP = ("Admin URL fresh PostgreSQL databases are created from (default $" + POSTGRES_ENV
           + ").")
OUT_HELP = "Folder of the JSON results (default bench/results/)."


def _stores(value: str, postgres_url: str | None) -> list[str]:
    stores = parse_stores(value)
    if "postgres" in stores and not postgres_admin_url(postgres_url):
        if value == "both":
            console.print(f"[yellow]no ${POSTGRES_ENV}: PostgreSQL skipped[/yellow]")
            return [s for s in stores if s != "postgres"]
        raise typer.BadParameter(f"--store postgres needs --postgres-url or ${POSTGRES_ENV}")
    return stores


def _out(value: str | None) -> Path | None:
    return Path(value) if value else None


def _run(fn: object, **kwargs: object) -> None:
    try:
        fn(**kwargs)  # type: ignore[operator]
    except BenchError as err:
        console.print(f"[red]benchmark failed:[/red] {err}")
        raise typer.Exit(1) from err


def _by_store(name: str, fn: object, *, calls: int, rounds: int, store: str,
              postgres_url: str | None, out: str | None) -> None:
    """Print the command, then run ``fn`` (a bench of ``calls`` by ``rounds`` on each store)."""
    command = _command(name, {"--calls": calls, "--rounds": rounds, "--store": store})
    console.print(f"[bold]{command}[/bold]")
    _run(fn, calls=calls, rounds=rounds, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command()
def throughput(
    calls: int = typer.Option(2000, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (A B C A B C ...)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    warmup: int = typer.Option(50, "--warmup", min=1, help="Calls per variant before round 1."),
    latency_calls: int = typer.Option(100, "--latency-calls", min=1,
                                      help="Calls made one at a time per variant per round, "
                                           "for the enqueue-to-terminal latency without a "
                                           "queue."),
    loglevel: str = typer.Option("WARNING", "--loglevel",
                                 help="Log level of both workers (the same for fairness)."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Raw Celery vs dex-tasks read vs single-attempt: calls/s, latencies, ratios."""
    from bench.throughput import run_throughput

    _run(run_throughput, calls=calls, rounds=rounds, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), warmup=warmup,
         latency_calls=latency_calls, loglevel=loglevel,
         out_dir=_out(out), console=console)


@app.command()
def latency(
    calls: int = typer.Option(100, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (first variant rotating)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    warmup: int = typer.Option(20, "--warmup", min=1, help="Calls per variant before round 1."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """One call at a time, by the caller's clock: call_tool + wait vs apply_async().get()."""
    from bench.latency import run_latency

    _run(run_latency, calls=calls, rounds=rounds, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), warmup=warmup, out_dir=_out(out),
         console=console)


@app.command()
def batch(
    turns: int = typer.Option(100, "--turns", min=1, help="Turns per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (first variant alternating)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """A turn of 5 parallel calls: call_tools vs 5 call_tool, send and results in hand."""
    from bench.batch import run_batch

    _run(run_batch, turns=turns, rounds=rounds, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command(name="tools")
def many_tools(
    counts: str = typer.Option("5,50,500", "--counts", help="Catalog sizes, comma-separated."),
    idle: float = typer.Option(10.0, "--idle", min=1, help="Seconds of idling measured."),
    latency_calls: int = typer.Option(100, "--latency-calls", min=1,
                                      help="Calls made one at a time per size."),
    burst: int = typer.Option(1000, "--burst", min=1, help="Calls sent together per size."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Many tools in the catalog: idle worker and Redis CPU, one call's latency, a burst."""
    from bench.many_tools import run_many_tools

    sizes = [int(c) for c in counts.split(",") if c.strip()]
    _run(run_many_tools, counts=sizes, idle=idle, latency_calls=latency_calls, burst=burst,
         out_dir=_out(out), console=console)


@app.command(name="io")
def io_bound(
    calls: int = typer.Option(2000, "--calls", min=1, help="Calls per variant per round."),
    seconds: float = typer.Option(1.0, "--seconds", min=0, help="How long each call sleeps."),
    concurrency: int = typer.Option(200, "-c", "--concurrency", min=1,
                                    help="Threads of each worker."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (first variant alternating)."),
    store: str = typer.Option("sqlite", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """I/O-bound calls on the threads pool: dex-tasks vs Celery, wall time and worker RSS."""
    from bench.io_bound import run_io

    _run(run_io, calls=calls, seconds=seconds, concurrency=concurrency, rounds=rounds,
         stores=_stores(store, postgres_url), postgres_url=postgres_admin_url(postgres_url),
         out_dir=_out(out), console=console)


@app.command()
def scrape(
    scales: str = typer.Option("100000,500000", "--scales",
                               help="Ended calls in the store, comma-separated (0 is added)."),
    open_calls: int = typer.Option(1000, "--open", min=0, help="Open calls throughout."),
    repeats: int = typer.Option(20, "--repeats", min=1, help="Scrapes timed per scale."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """/metrics scrape time with 0, 100k and 500k ended calls in the store."""
    from bench.scrape import run_scrape
    from bench.sweep_scale import parse_scales

    _run(run_scrape, scales=parse_scales(scales), open_calls=open_calls, repeats=repeats,
         stores=_stores(store, postgres_url), postgres_url=postgres_admin_url(postgres_url),
         out_dir=_out(out), console=console)


@app.command()
def sweeps(
    scales: str = typer.Option("10000,100000,1000000", "--scales",
                               help="Pending calls per run, comma-separated."),
    max_pending: int | None = typer.Option(None, "--max-pending", min=1,
                                           help="Skip scales above this (quick runs)."),
    overdue: int = typer.Option(1000, "--overdue", min=1, help="Overdue calls per sweep."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Sweeps timed per scale."),
    jobs: str = typer.Option("expire_approvals,reap_expired_leases,republish_stranded",
                             "--jobs", help="Sweep jobs to time (names of sweeps.JOBS)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Sweep time with N overdue calls among 10k / 100k / 1M pending."""
    from bench.sweep_scale import parse_jobs, parse_scales, run_sweeps

    _run(run_sweeps, scales=parse_scales(scales, max_pending), overdue=overdue,
         repeats=repeats, jobs=parse_jobs(jobs), stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command()
def memory(
    calls: int = typer.Option(100_000, "--calls", min=1, help="Calls measured."),
    warmup: int = typer.Option(2000, "--warmup", min=1, help="Calls before the first sample."),
    batch: int = typer.Option(500, "--batch", min=1, help="Calls in flight at a time."),
    store: str = typer.Option("sqlite", "--store", help="sqlite or postgres."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Worker RSS (main + children) before and after N calls, as MB per 100k calls."""
    from bench.memory import run_memory

    stores = _stores(store, postgres_url)
    if len(stores) != 1:
        raise typer.BadParameter("--store must name one store for the memory benchmark")
    _run(run_memory, calls=calls, warmup=warmup, batch=batch, store=stores[0],
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command()
def roundtrips(
    calls: int = typer.Option(200, "--calls", min=1, help="Calls per path and store."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    end_to_end: bool = typer.Option(True, "--end-to-end/--no-end-to-end",
                                    help="Also count Redis commands with real workers."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Store statements, transactions, connections and Redis commands per call."""
    from bench.roundtrips import run_roundtrips

    _run(run_roundtrips, calls=calls, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), end_to_end=end_to_end, out_dir=_out(out),
         console=console)


@app.command()
def driver(
    calls: int = typer.Option(1000, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """A call's claim and finish through the store vs the same statements through the driver."""
    from bench.driver import run_driver

    _run(run_driver, calls=calls, rounds=rounds, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command()
def held(
    calls: int = typer.Option(1000, "--calls", min=1, help="Operations per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """CPU per store operation with each engine's last connection held, and with the pool."""
    from bench.held import run_held

    _by_store("held", run_held, calls=calls, rounds=rounds, store=store,
              postgres_url=postgres_url, out=out)


@app.command()
def child(
    calls: int = typer.Option(1000, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """A worker child's part of a call, piece by piece, beside the contract's floor."""
    from bench.child import run_child

    _by_store("child", run_child, calls=calls, rounds=rounds, store=store,
              postgres_url=postgres_url, out=out)


@app.command()
def producer(
    calls: int = typer.Option(1000, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """The producer's part of a call (call_tool, wait), piece by piece, beside the floor's."""
    from bench.producer import run_producer

    _by_store("producer", run_producer, calls=calls, rounds=rounds, store=store,
              postgres_url=postgres_url, out=out)


@app.command()
def overlap(
    calls: int = typer.Option(500, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (after a warm-up round)."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """call_tool's insert and publish on PostgreSQL, one after the other and overlapped."""
    from bench.overlap import run_overlap

    command = _command("overlap", {"--calls": calls, "--rounds": rounds})
    console.print(f"[bold]{command}[/bold]")
    _run(run_overlap, calls=calls, rounds=rounds,
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


@app.command()
def pooler(
    calls: int = typer.Option(500, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """A call's store writes direct, without prepared statements, and through PgBouncer."""
    from bench.pooler import run_pooler

    _run(run_pooler, calls=calls, rounds=rounds, postgres_url=postgres_admin_url(postgres_url),
         out_dir=_out(out), console=console)


@app.command(name="mcp")
def mcp_latency(
    calls: int = typer.Option(200, "--calls", min=1, help="Calls per variant."),
    warmup: int = typer.Option(20, "--warmup", min=1, help="Calls per variant before timing."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """What dex-tasks mcp adds: a no-op read in process, over stdio and over HTTP."""
    from bench.mcp_latency import run_mcp_latency

    _run(run_mcp_latency, calls=calls, warmup=warmup, out_dir=_out(out), console=console)


@app.command(name="profile")
def profile_(
    calls: int = typer.Option(500, "--calls", min=1, help="Calls profiled per store."),
    top: int = typer.Option(15, "--top", min=1, help="Functions listed."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """The producer under cProfile: call_tool and a call_tools burst vs apply_async."""
    from bench.profile import run_profile

    _run(run_profile, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), calls=calls, top=top, console=console,
         out_dir=_out(out))


@app.command(name="approval-rules")
def approval_rules(
    n: int = typer.Option(20_000, "--n", min=1, help="Rule checks per round (5 rounds)."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """The cost of a rule on the arguments per call, in µs (pure CPU)."""
    from bench.approval_rules import run_approval_rules

    _run(run_approval_rules, n=n, out_dir=_out(out), console=console)


@app.command(name="webhooks")
def webhooks(
    calls: int = typer.Option(100, "--calls", min=1, help="Calls, one webhook each."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Webhook delivery latency, from the event's commit to the receiver: p50/p99/max."""
    from bench.webhook_latency import run_webhook_latency

    _run(run_webhook_latency, calls=calls, stores=_stores(store, postgres_url),
         postgres_url=postgres_admin_url(postgres_url), out_dir=_out(out), console=console)


def _command(name: str, options: dict[str, object]) -> str:
    """The command line that makes these figures (the options given, defaults left out)."""
    parts = [f"python -m bench {name}"]
    for flag, value in options.items():
        if value is True:
            parts.append(flag)
        elif value not in (None, False):
            parts.append(f"{flag} {value}")
    return " ".join(parts)


WORKLOAD_PG_HELP = ("PostgreSQL admin URL to create the store in (default: a private server "
                    "started for the run with pg_stat_statements, whose CPU is counted).")


@app.command()
def workload(
    calls: int | None = typer.Option(None, "--calls", min=1,
                                     help="Calls per throughput round (default DESIGN's 2,000; "
                                          "the old shape gets a quarter)."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Throughput rounds per shape."),
    store: str = typer.Option("sqlite,postgres", "--store", help="sqlite, postgres or both."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=WORKLOAD_PG_HELP),
    warmup: int = typer.Option(50, "--warmup", min=1, help="Calls of each before the rounds."),
    latency_calls: int = typer.Option(200, "--latency-calls", min=0,
                                      help="One-at-a-time calls of each (0: skip)."),
    io_calls: int | None = typer.Option(None, "--io-calls", min=1,
                                        help="I/O burst calls (default DESIGN's 1,000)."),
    io_seconds: float = typer.Option(1.0, "--io-seconds", min=0, help="Each I/O call's sleep."),
    io_concurrency: int = typer.Option(200, "--io-concurrency", min=1,
                                       help="Threads of each I/O worker."),
    io_rounds: int = typer.Option(2, "--io-rounds", min=1, help="I/O burst rounds."),
    old: bool = typer.Option(True, "--old/--no-old",
                             help="Also run the old benchmark's shape beside DESIGN's."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """DESIGN's workload (version 4) vs plain Celery, beside the old shape; CPU per process."""
    from bench.infra import parse_stores
    from bench.workload_report import run_workload

    command = _command("workload", {"--calls": calls, "--rounds": rounds, "--store": store,
                                    "--latency-calls": latency_calls, "--io-calls": io_calls,
                                    "--io-seconds": io_seconds, "--io-rounds": io_rounds,
                                    "--no-old": not old,
                                    "--postgres-url": postgres_url and "URL"})
    _run(run_workload, calls=calls, rounds=rounds, stores=parse_stores(store),
         postgres_url=postgres_url, warmup=warmup, latency_calls=latency_calls,
         io_calls=io_calls, io_seconds=io_seconds, io_concurrency=io_concurrency,
         io_rounds=io_rounds, with_old=old, command=command, out_dir=_out(out), console=console)


@app.command()
def gap(
    calls: int | None = typer.Option(None, "--calls", min=1,
                                     help="DESIGN's calls (default 2,000); every shape scaled "
                                          "alike."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds per shape."),
    store: str = typer.Option("sqlite,postgres", "--store", help="sqlite, postgres or both."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=WORKLOAD_PG_HELP),
    warmup: int = typer.Option(50, "--warmup", min=1, help="Calls of each before a shape."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Old shape -> DESIGN's, one factor at a time (AOF, calls, sessions, turns): the ratios."""
    from bench.infra import parse_stores
    from bench.workload_report import run_gap

    command = _command("gap", {"--calls": calls, "--rounds": rounds, "--store": store,
                               "--postgres-url": postgres_url and "URL"})
    _run(run_gap, calls=calls, rounds=rounds, stores=parse_stores(store),
         postgres_url=postgres_url, warmup=warmup, command=command, out_dir=_out(out),
         console=console)


@app.command()
def pgindex(
    calls: int = typer.Option(300, "--calls", min=1, help="Calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    postgres_url: str | None = typer.Option(
        None, "--postgres-url", help="Admin URL of a server that preloads pg_stat_statements "
                                     "and auto_explain (default: a private server)."),
    ended: int = typer.Option(50_000, "--ended", min=0,
                              help="Ended calls in the store when the reads are explained."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """PostgreSQL per call: each hot statement's and each index's cost; the reads' plans."""
    from bench.pgindex import run_pgindex

    command = _command("pgindex", {"--calls": calls, "--rounds": rounds, "--ended": ended,
                                   "--postgres-url": postgres_url and "URL"})
    _run(run_pgindex, calls=calls, rounds=rounds, postgres_url=postgres_url,
         populate_ended=ended, command=command, out_dir=_out(out), console=console)


@app.command()
def floor(
    calls: int | None = typer.Option(None, "--calls", min=1,
                                     help="Calls per round (default DESIGN's 2,000)."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants alternate)."),
    store: str = typer.Option("postgres,sqlite", "--store", help="sqlite, postgres or both."),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=WORKLOAD_PG_HELP),
    warmup: int = typer.Option(50, "--warmup", min=1, help="Calls of each before the rounds."),
    latency_calls: int = typer.Option(200, "--latency-calls", min=0,
                                      help="One-at-a-time calls of each (0: skip)."),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Celery, the contract's floor (its store and Redis work by bare clients) and dex-tasks."""
    from bench.floor import run_floor_bench
    from bench.infra import parse_stores

    command = _command("floor", {"--calls": calls, "--rounds": rounds, "--store": store,
                                 "--latency-calls": latency_calls,
                                 "--postgres-url": postgres_url and "URL"})
    _run(run_floor_bench, calls=calls, rounds=rounds, stores=parse_stores(store),
         postgres_url=postgres_url, warmup=warmup, latency_calls=latency_calls,
         command=command, out_dir=_out(out), console=console)


@app.command(name="all")
def all_(
    quick: bool = typer.Option(False, "--quick",
                               help="Small sizes: 500 calls x 2 rounds, 400 I/O calls, up to "
                                    "100k pending or ended, 10k calls for memory."),
    store: str = typer.Option("both", "--store", help=STORE_HELP),
    postgres_url: str | None = typer.Option(None, "--postgres-url", help=PG_HELP),
    out: str | None = typer.Option(None, "--out", help=OUT_HELP),
) -> None:
    """Every benchmark in turn (what ``make bench`` runs), then every target in one table."""
    from bench.approval_rules import run_approval_rules
    from bench.batch import run_batch
    from bench.driver import run_driver
    from bench.io_bound import run_io
    from bench.latency import run_latency
    from bench.memory import run_memory
    from bench.profile import run_profile
    from bench.scrape import run_scrape
    from bench.sweep_scale import DEFAULT_JOBS, parse_scales, run_sweeps
    from bench.targets import print_targets
    from bench.throughput import run_throughput
    from bench.webhook_latency import run_webhook_latency

    stores = _stores(store, postgres_url)
    pg = postgres_admin_url(postgres_url)
    common: dict[str, Any] = {"stores": stores, "postgres_url": pg, "out_dir": _out(out),
                              "console": console}
    console.print("[bold]python -m bench all" + (" --quick" if quick else "")
                  + f" --store {store}[/bold]")
    try:
        results = [
            run_throughput(calls=500 if quick else 2000, rounds=2 if quick else 3, **common),
            run_latency(calls=30 if quick else 100, rounds=2 if quick else 3, **common),
            run_batch(turns=20 if quick else 100, rounds=2 if quick else 3, **common),
            # The producer under cProfile: where call_tool's time goes, and a burst.
            run_profile(calls=300 if quick else 1000, top=12, **common),
            run_driver(calls=200 if quick else 1000, rounds=2 if quick else 3, **common),
            run_io(calls=400 if quick else 2000, seconds=1.0, concurrency=200,
                   rounds=1 if quick else 3, **{**common, "stores": stores[:1]}),
            run_scrape(scales=[100_000] if quick else [100_000, 500_000], open_calls=1000,
                       repeats=20, **common),
            run_sweeps(scales=parse_scales("10000,100000,1000000", 100_000 if quick else None),
                       overdue=1000, repeats=3, jobs=list(DEFAULT_JOBS), **common),
            run_memory(calls=10_000 if quick else 100_000, warmup=2000, batch=500,
                       store=stores[0], postgres_url=pg, out_dir=_out(out), console=console),
            run_approval_rules(n=2000 if quick else 20_000, out_dir=_out(out), console=console),
            run_webhook_latency(calls=20 if quick else 100, **common),
        ]
    except BenchError as err:
        console.print(f"[red]benchmark failed:[/red] {err}")
        raise typer.Exit(1) from err
    print_targets(console, [t for r in results for t in r["targets"]],
                  title="All targets (reported, not asserted)")


@app.command()
def tracing(
    calls: int = typer.Option(2000, "--calls", min=1, help="Timed calls per variant per round."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds (variants interleaved)."),
) -> None:
    """call_tool with OpenTelemetry not installed, not configured, configured (issue 31)."""
    from bench.tracing_cost import run as run_tracing

    run_tracing(calls=calls, rounds=rounds, console=console)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
