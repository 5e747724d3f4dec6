"""The ``dex-tasks`` commands that run a process: ``worker``, ``beat``, ``api``, ``mcp``,
``demo``, ``dev``, and ``sweep`` (beat's jobs once, in this process)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib.metadata import entry_points

import typer

from dex_tasks.broker.celery_app import create_app
from dex_tasks.broker.preflight import refuse_if_refused, until_redis_answers
from dex_tasks.errors import ConfigurationError
from dex_tasks.logs import setup_process_logging, visible
from dex_tasks.ops.cli_common import (
    LOG_FORMAT_OPTION,
    console,
    import_tool_modules,
    positive_seconds,
    secret_or_none,
    tool_modules,
    until_store_answers,
)
from dex_tasks.ops.cli_render import print_json
from dex_tasks.registry import local_tools
from dex_tasks.settings import DexSettings
from dex_tasks.store import Store, catalog

commands = typer.Typer()


POOLS = ("prefork", "threads")


@commands.command(context_settings={"allow_extra_args": True,
                                     "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    tools: str | None = typer.Option(
        None, "--tools", help="Tool modules to import, comma-separated (default: DEX_TOOLS).",
        show_default=False),
    serve: str | None = typer.Option(
        None, "--serve",
        help="Serve only these tools (names or patterns such as 'http_*', comma-separated; "
             "default: every tool the modules define). Calls of a tool go only to workers "
             "that serve it.",
    ),
    concurrency: int = typer.Option(2, "-c", "--concurrency", min=1,
                                    help="Worker processes (prefork) or threads (threads)."),
    pool: str = typer.Option(
        "prefork", "-P", "--pool",
        help="prefork: a process per call, time limits kill the tool (CPU-bound tools). "
             "threads: many I/O-bound calls per process; a thread cannot be killed, so a call "
             "past its time limit is ended and its thread abandoned.",
        callback=lambda value: check_pool(value),
    ),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
    events: bool = typer.Option(
        False, "-E", "--events",
        help="Send Celery task events (for `celery events` and Flower's task lists); off by "
             "default, as in Celery, since each costs a Redis publish.",
    ),
    hostname: str | None = typer.Option(
        None, "-n", "--hostname",
        help="Node name, as Celery's (e.g. 'w1@%h'; default 'dex-<pid>@%h'). A name a live "
             "worker holds is refused."),
    max_tasks_per_child: int | None = typer.Option(
        None, "--max-tasks-per-child", min=1,
        help="Replace a prefork child after it ran this many calls."),
    max_memory_per_child: int | None = typer.Option(
        None, "--max-memory-per-child", min=1,
        help="Replace a prefork child once its resident memory passes this many KiB (after "
             "its call ends)."),
    autoscale: str | None = typer.Option(
        None, "--autoscale", metavar="MAX,MIN",
        help="Grow the prefork pool up to MAX children under load and shrink it to MIN "
             "(replaces -c; only idle children are stopped)."),
    prefetch_multiplier: int | None = typer.Option(
        None, "--prefetch-multiplier",
        help="Reserve this many messages per slot (default: take one only when a slot is "
             "free). Reserved messages of a lost worker are restored by beat; they wait "
             "behind busy slots meanwhile."),
    optimization: str | None = typer.Option(
        None, "-O", "--optimization", help="Celery's optimization profile: default or fair."),
    without_gossip: bool = typer.Option(
        False, "--without-gossip", help="Always on: dex-tasks workers never gossip."),
    without_mingle: bool = typer.Option(
        False, "--without-mingle", help="Always on: dex-tasks workers never mingle."),
    without_heartbeat: bool = typer.Option(
        False, "--without-heartbeat",
        help="No Celery worker heartbeats (Flower and `celery events` then see no worker)."),
) -> None:
    """Run a Celery worker for the tools in MODULE[,MODULE], consuming their queues.

    Other Celery worker options are passed to Celery's worker (`celery worker --help`);
    those that would change what dex-tasks guarantees are refused with the reason.
    """
    from dex_tasks.broker.routing import ServeSelectionError, select_tools
    from dex_tasks.ops.worker_options import WorkerOptions

    del without_gossip, without_mingle  # always off (worker_options.py says why)
    # A refused option is a WorkerOptionError: one line naming it and why (cli.main).
    options = WorkerOptions(
        pool=pool, concurrency=concurrency, hostname=hostname,
        max_tasks_per_child=max_tasks_per_child, max_memory_per_child=max_memory_per_child,
        autoscale=autoscale, prefetch_multiplier=prefetch_multiplier,
        optimization=optimization, without_heartbeat=without_heartbeat,
        passthrough=tuple(ctx.args))
    settings = DexSettings()
    setup_process_logging(log_format, loglevel, secret_or_none(settings),
                          celery=True)
    import_tool_modules(tool_modules(tools, settings, required=True))
    registered = local_tools()
    try:
        served = select_tools(registered, serve)
    except ServeSelectionError as err:
        raise typer.BadParameter(str(err), param_hint="--serve") from None
    # Redis first, then the store, then Celery: its banner comes once both answer, and a
    # refused password or command ends the worker here, in one line, instead of being
    # retried for ever.
    until_redis_answers(settings, "worker")
    store = Store(settings.database_url)
    # Every imported tool's definition (policy, schema) is published, served here or not:
    # which tools have a live worker is a separate, expiring record (routing.Presence).

    def prepare_store() -> int:
        store.create_all()
        return catalog.publish(store, registered.values())

    count = until_store_answers(prepare_store)
    store.close()
    logging.getLogger("dex_tasks").info("catalog published", extra={"action": "catalog_published",
                                                                     "tools": count})
    from dex_tasks.worker.main_process import worker_app

    if hostname is not None:
        refuse_taken_node_name(settings, options.node_name())
    celery = worker_app(settings, served, pool=pool, concurrency=options.slots)
    # Set on the app (not only Celery's -E) so the task bodies' own events (task-ignored, see
    # task_states.ignored) follow the same switch.
    celery.conf.worker_send_task_events = events
    # Prefetch only when asked for (see worker_options.py for what it costs).
    celery.conf.worker_disable_prefetch = not options.prefetches
    # JSON logs: no banner, so every line a collector reads is one JSON object. Leases are
    # owned by "<node>:<pid>[:<thread>]", unique per process whatever the node name.
    celery.worker_main(options.celery_args(loglevel, quiet=log_format == "json"))


def refuse_taken_node_name(settings: DexSettings, node: str) -> None:
    """Exit with one line if a live worker already announces ``node`` (see worker_options)."""
    import redis

    from dex_tasks.broker.redis_clients import redis_client
    from dex_tasks.broker.routing import announcement
    from dex_tasks.ops.worker_options import WorkerOptionError, hostname_taken

    client = redis_client(settings, socket_timeout=5)
    try:
        record = announcement(client, node)
    except redis.RedisError:
        return  # Redis is not answering yet: the worker's own start-up waits for it
    finally:
        client.close()
    why = hostname_taken(record)
    if why is not None:
        raise WorkerOptionError(why)


def check_pool(value: str) -> str:
    """Refuse an unknown --pool with a message that names the choices."""
    if value not in POOLS:
        raise typer.BadParameter(f"must be one of {', '.join(POOLS)}, got {value!r}")
    return value


@commands.command()
def beat(
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Run Celery beat with the schedule of dex_tasks/worker/schedule.py; it runs the sweeps
    itself."""
    from dex_tasks.worker import schedule as beat_schedule

    settings = DexSettings()
    setup_process_logging(log_format, loglevel, secret_or_none(settings),
                          celery=True)
    # A Redis that refuses beat is one line now; one that is down is not waited for: the
    # deadline and lease sweeps need only the store, and run meanwhile.
    refuse_if_refused(settings, "beat", timeout=5.0)
    store = Store(settings.database_url)
    until_store_answers(store.create_all)
    store.close()
    celery = create_app(settings)
    celery.conf.beat_schedule = beat_schedule.build(settings)
    # Runs the sweeps in this process (see dex_tasks/worker/beat.py); only reconcile_unknown
    # is sent.
    celery.conf.beat_scheduler = "dex_tasks.worker.beat:SweepScheduler"
    # The lock keeps this schedule file ours while beat runs: held open until the process ends.
    state, _lock = beat_schedule.schedule_file(settings.state_dir)
    quiet = ["--quiet"] if log_format == "json" else []
    celery.start([*quiet, "beat", "--loglevel", loglevel, "--schedule", str(state)])


@commands.command()
def api(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Serve the HTTP API and the approval page (OpenAPI at /docs)."""
    from dex_tasks.api import serve

    settings = DexSettings()
    setup_process_logging(log_format, loglevel, secret_or_none(settings),
                          celery=False)
    try:
        serve(settings, host=host, port=port, log_level=loglevel.lower())
    except ConfigurationError as err:
        # Refuse to serve rather than sign with a guessable key; say what to set.
        typer.echo(f"error: {visible(str(err))}", err=True)
        raise typer.Exit(2) from None


@commands.command()
def mcp(
    http: bool = typer.Option(False, "--http", help="Serve streamable HTTP instead of stdio."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (--http)."),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="TCP port (--http)."),
    session: str | None = typer.Option(
        None, "--session", envvar="DEX_MCP_SESSION",
        help="The dex session of stdio calls, which a client's _meta cannot change (and of "
             "operator tokens' calls naming none)."),
    approval_timeout: float = typer.Option(
        60.0, "--approval-timeout", callback=lambda v: positive_seconds(v),
        help="Seconds a call waits for a person before it answers that it awaits approval."),
    call_timeout: float = typer.Option(
        120.0, "--call-timeout", callback=lambda v: positive_seconds(v),
        help="Seconds a call waits for its tool before it answers that it still runs."),
    page_url: str | None = typer.Option(
        None, "--page-url", envvar="DEX_MCP_PAGE_URL",
        help="The API's public address, for the approval page's link in results."),
    max_sessions: int = typer.Option(
        10_000, "--max-sessions", min=1, help="MCP sessions open at once, all tokens (--http)."),
    max_sessions_per_token: int = typer.Option(
        16, "--max-sessions-per-token", min=1,
        help="MCP sessions one token may hold open; past it, 429 (--http)."),
    max_requests_per_token: int = typer.Option(
        32, "--max-requests-per-token", min=1,
        help="Requests of one token in progress at once (a tools/call waiting for approval "
             "is one); past it, 429 (--http)."),
    loglevel: str = typer.Option("WARNING", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Serve the published tools as an MCP server (stdio, or streamable HTTP with tokens)."""
    settings = DexSettings()
    serve = server_entry_point("mcp")
    # Logs go to stderr: on stdio, stdout is the MCP channel.
    setup_process_logging(log_format, loglevel, secret_or_none(settings), celery=False)
    serve(settings, http=http, host=host, port=port, session_id=session,
          approval_timeout=approval_timeout, call_timeout=call_timeout, page_url=page_url,
          log_level=loglevel.lower(), max_sessions=max_sessions,
          max_sessions_per_token=max_sessions_per_token,
          max_requests_per_token=max_requests_per_token)


SERVERS_GROUP = "dex_tasks.servers"


def server_entry_point(name: str) -> Callable[..., None]:
    """The server an integration registers under ``name`` in the ``dex_tasks.servers`` entry
    point group (pyproject.toml), loaded only when its command runs.

    The core never imports an integration (nor its framework): the integration declares what
    serves, and a missing extra is one line that names it, exit status 2.
    """
    found = entry_points(group=SERVERS_GROUP, name=name)
    if not found:
        typer.echo(f"error: no {name!r} server is registered in the {SERVERS_GROUP!r} entry "
                   "points: reinstall dex-tasks (pip install dex-tasks)", err=True)
        raise typer.Exit(2)
    try:
        serve: Callable[..., None] = next(iter(found)).load()
    except ImportError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    return serve


@commands.command()
def demo(
    keep_running: bool = typer.Option(
        False, "--keep-running",
        help="Leave the stack up after the run (with an approval waiting for you); Ctrl-C "
             "stops it.",
    ),
) -> None:
    """Run the whole system on this machine and drive an agent through every path.

    With no configuration: an embedded Redis server, a SQLite store in a temporary folder, a
    worker, beat and the API. DEX_REDIS_URL / DEX_DATABASE_URL replace them. Exits 0 only if
    every path reached the outcome it announced; every process it started is stopped on exit.
    """
    from dex_tasks.ops.demo import run

    raise typer.Exit(run(keep_running=keep_running, console=console))


@commands.command()
def dev(
    tools: str = typer.Option(..., "--tools",
                              help="Your tool modules, comma-separated (e.g. my_tools)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535,
                             help="The API's port (0, or a port in use: any free one)."),
    concurrency: int = typer.Option(2, "-c", "--concurrency", min=1,
                                    help="The worker's processes."),
) -> None:
    """Run your tools on this machine: Redis, a worker, beat and the API, in one command.

    An embedded Redis (or DEX_REDIS_URL), a SQLite store in this folder (dex.db, or
    DEX_DATABASE_URL), a worker for MODULE, beat and the API. Prints the session pages'
    address with an operator token and the exports an agent needs; a saved change to a tool
    module restarts the worker; Ctrl-C stops everything.
    """
    from dex_tasks.ops.dev import run

    raise typer.Exit(run(tools, port=port, concurrency=concurrency, console=console))


@commands.command()
def sweep(
    tools: str | None = typer.Option(
        None, "--tools",
        help="Tool modules to import, so their registered reconcilers run too "
             "(default: DEX_TOOLS).",
    ),
) -> None:
    """Run every periodic job of the beat schedule once, now."""
    from dex_tasks.worker.execution import runtime
    from dex_tasks.worker.sweeps import run_all

    settings = DexSettings()
    import_tool_modules(tool_modules(tools, settings, required=False))
    # A refused password or command is one line, before any job meets it (each job would
    # log its own Redis failure and go on).
    refuse_if_refused(settings, "beat", timeout=5.0)
    rt = runtime(create_app(settings))
    rt.store.create_all()
    print_json(console, json.dumps(run_all(rt)))
