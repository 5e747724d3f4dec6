"""The ``dex-tasks`` command. Thin: it parses, builds settings, and calls the library."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Literal, TypeVar

import typer
from rich.console import Console

from dex_tasks.broker.celery_app import create_app
from dex_tasks.errors import ConfigurationError, DexError, StoreUnavailableError
from dex_tasks.logs import FORMATS, setup_process_logging, visible
from dex_tasks.ops.cli_render import print_json, user_markup
from dex_tasks.registry import local_tools
from dex_tasks.settings import DexSettings, settings_help
from dex_tasks.store import Store, catalog

app = typer.Typer(
    help="Run AI agents' tool calls as Celery tasks.\n\nConfiguration (environment):\n\n"
    + settings_help().replace("\n", "\n\n"),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()

LOG_FORMAT_OPTION = typer.Option(
    "text", "--log-format",
    help=f"Log lines as {' or '.join(FORMATS)} (json: one object per line, for collectors).",
    callback=lambda value: check_log_format(value),
)


def check_log_format(value: str) -> str:
    """Refuse an unknown --log-format with a message that names the choices."""
    if value not in FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(FORMATS)}, got {value!r}")
    return value


T = TypeVar("T")

STARTUP_STORE_WAIT_SECONDS = 60.0


def until_store_answers(step: Callable[[], T], wait: float = STARTUP_STORE_WAIT_SECONDS) -> T:
    """Run a start-up ``step`` that needs the store, again while the store cannot be reached
    (a database restarting as the worker or beat starts, a connection dropped), for up to
    ``wait`` seconds; then the store's error, which the CLI prints in one line.

    An out-of-date schema or a bad setting is not waited for: it is raised at once.
    """
    deadline = time.monotonic() + wait
    pause = 0.5
    while True:
        try:
            return step()
        except StoreUnavailableError as err:
            if time.monotonic() + pause > deadline:
                raise
            logging.getLogger("dex_tasks").warning(
                "the store is not answering yet; trying again",
                extra={"action": "startup_store_wait", "error": str(err)[:300]})
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _secret_or_none(settings: DexSettings) -> str | None:
    """The signing key for log redaction, if one is set (workers and beat need none)."""
    return settings.secret_key.get_secret_value() if settings.secret_key else None


def import_tool_modules(modules: str) -> list[str]:
    """Import ``a.b,c`` the way ``celery -A`` does, with the current directory on the path.

    A module that cannot be found is a :class:`ConfigurationError` naming it (a typo in
    ``--tools``, or a dependency of the tools that is not installed); any other error in a
    tool module propagates with its traceback, which is what its author needs.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    names = [m.strip() for m in modules.split(",") if m.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing = err.name or "?"
            if name == missing or name.startswith(missing + "."):
                raise ConfigurationError(
                    f"cannot import tool module {name!r}: no module named {missing!r} "
                    f"(check --tools / DEX_TOOLS and that it is on PYTHONPATH)"
                ) from None
            raise ConfigurationError(
                f"tool module {name!r} imports {missing!r}, which is not installed here"
            ) from None
    return names


def tool_modules(option: str | None, settings: DexSettings, *, required: bool) -> str:
    """The tool modules to import: ``--tools`` if given, else ``DEX_TOOLS``."""
    modules = option if option is not None else (settings.tools or "")
    if required and not modules.strip():
        raise ConfigurationError("no tool modules: pass --tools MODULE[,MODULE] or set "
                                 "DEX_TOOLS (e.g. DEX_TOOLS=my_company.tools)")
    return modules


def positive_seconds(value: float) -> float:
    """Option callback: a finite number of seconds above zero (typer names the option)."""
    if not math.isfinite(value) or value <= 0:
        raise typer.BadParameter(f"must be a positive number of seconds, got {value!r}")
    return value


POOLS = ("prefork", "threads")


@app.command()
def worker(
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
) -> None:
    """Run a Celery worker for the tools in MODULE[,MODULE], consuming their queues."""
    from dex_tasks.broker.routing import ServeSelectionError, select_tools

    settings = DexSettings()
    setup_process_logging(log_format, loglevel, _secret_or_none(settings),
                          celery=True)
    import_tool_modules(tool_modules(tools, settings, required=True))
    registered = local_tools()
    try:
        served = select_tools(registered, serve)
    except ServeSelectionError as err:
        raise typer.BadParameter(str(err), param_hint="--serve") from None
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

    celery = worker_app(settings, served, pool=pool, concurrency=concurrency)
    # Set on the app (not only Celery's -E) so the task bodies' own events (task-ignored, see
    # task_states.ignored) follow the same switch.
    celery.conf.worker_send_task_events = events
    celery.worker_main([
        # JSON logs: no banner, so every line a collector reads is one JSON object.
        *(["--quiet"] if log_format == "json" else []),
        "worker",
        "-c", str(concurrency),
        "-P", pool,
        # A unique node name per process: leases are owned by "<node>:<pid>[:<thread>]".
        "-n", f"dex-{os.getpid()}@%h",
        "--loglevel", loglevel,
        "--without-gossip", "--without-mingle",
    ])


def check_pool(value: str) -> str:
    """Refuse an unknown --pool with a message that names the choices."""
    if value not in POOLS:
        raise typer.BadParameter(f"must be one of {', '.join(POOLS)}, got {value!r}")
    return value


@app.command()
def beat(
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Run Celery beat with the schedule of dex_tasks/worker/schedule.py; it runs the sweeps
    itself."""
    from dex_tasks.worker import schedule as beat_schedule

    settings = DexSettings()
    setup_process_logging(log_format, loglevel, _secret_or_none(settings),
                          celery=True)
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


@app.command()
def api(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Serve the HTTP API and the approval page (OpenAPI at /docs)."""
    from dex_tasks.api import serve
    from dex_tasks.errors import ConfigurationError

    settings = DexSettings()
    setup_process_logging(log_format, loglevel, _secret_or_none(settings),
                          celery=False)
    try:
        serve(settings, host=host, port=port, log_level=loglevel.lower())
    except ConfigurationError as err:
        # Refuse to serve rather than sign with a guessable key; say what to set.
        typer.echo(f"error: {visible(str(err))}", err=True)
        raise typer.Exit(2) from None


@app.command()
def mcp(
    http: bool = typer.Option(False, "--http", help="Serve streamable HTTP instead of stdio."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (--http)."),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="TCP port (--http)."),
    session: str | None = typer.Option(
        None, "--session", envvar="DEX_MCP_SESSION",
        help="The dex session of stdio calls (and of operator tokens' calls naming none)."),
    approval_timeout: float = typer.Option(
        60.0, "--approval-timeout", callback=lambda v: positive_seconds(v),
        help="Seconds a call waits for a person before it answers that it awaits approval."),
    call_timeout: float = typer.Option(
        120.0, "--call-timeout", callback=lambda v: positive_seconds(v),
        help="Seconds a call waits for its tool before it answers that it still runs."),
    page_url: str | None = typer.Option(
        None, "--page-url", envvar="DEX_MCP_PAGE_URL",
        help="The API's public address, for the approval page's link in results."),
    loglevel: str = typer.Option("WARNING", "--loglevel", "-l"),
    log_format: str = LOG_FORMAT_OPTION,
) -> None:
    """Serve the published tools as an MCP server (stdio, or streamable HTTP with tokens)."""
    # Loaded by name, as --tools modules are: the core never imports an integration (nor the
    # mcp SDK); without the extra the import fails with the one line that names it.
    try:
        mcp_server = importlib.import_module("dex_tasks.integrations.mcp_server")
    except ImportError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    from dex_tasks.agent.async_client import AsyncDexClient

    settings = DexSettings()
    # Logs go to stderr: on stdio, stdout is the MCP channel.
    setup_process_logging(log_format, loglevel, _secret_or_none(settings), celery=False)
    secret = settings.signing_key() if http else None
    client = AsyncDexClient(settings)
    dex = mcp_server.DexMCPServer(client, session_id=session, approval_timeout=approval_timeout,
                                  call_timeout=call_timeout, page_url=page_url)
    try:
        if secret is not None:
            mcp_server.serve_http(dex, secret, host=host, port=port, log_level=loglevel.lower())
        else:
            mcp_server.run_stdio(dex)
    finally:
        client.sync.close()


@app.command()
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


@app.command()
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
    rt = runtime(create_app(settings))
    rt.store.create_all()
    print_json(console, json.dumps(run_all(rt)))


@app.command()
def status(
    check: str | None = typer.Option(
        None, "--check",
        help="Check one part only, for a container's healthcheck: 'worker' (a worker on this "
             "host has announced itself) or 'beat' (a sweep ran within 3 sweep intervals).",
    ),
) -> None:
    """Whether the store and Redis answer, which workers are alive, and whether beat sweeps.

    Exits 1 when something is wrong (each line says what to do), 0 otherwise.
    """
    import socket

    import redis
    from sqlalchemy import text

    from dex_tasks.broker.metrics import (
        BEAT_LATE_INTERVALS,
        beat_is_late,
        last_sweep_at,
        metrics_redis,
    )
    from dex_tasks.broker.routing import live_workers
    from dex_tasks.logs import redact

    if check not in (None, "worker", "beat"):
        raise typer.BadParameter("must be worker or beat", param_hint="--check")
    settings = DexSettings()
    problems: list[str] = []
    lines: list[str] = []
    if check is None:
        store = Store(settings.database_url)
        try:
            with store.read() as conn:
                conn.execute(text("SELECT 1"))
            lines.append(f"store    ok  {redact(settings.database_url)}")
        except DexError as err:
            problems.append(f"store    DOWN  {err}")
        finally:
            store.close()
    try:
        client = metrics_redis(settings)
        workers = live_workers(client)
        last = last_sweep_at(client)
    except redis.RedisError as err:
        typer.echo(f"redis    DOWN  {redact(settings.redis_url)}: {err}", err=True)
        raise typer.Exit(1) from None  # workers and beat are announced in Redis: unknown
    if check is None:
        lines.append(f"redis    ok  {redact(settings.redis_url)}")
    interval = settings.sweep_interval_seconds
    if check in (None, "worker"):
        host = socket.gethostname()
        mine = [w for w in workers if w.get("host") == host]
        if check == "worker" and not mine:
            problems.append(f"worker   NONE on {host}: no worker here announced itself in "
                            "Redis (is `dex-tasks worker` running and reaching Redis?)")
        elif not workers:
            problems.append("workers  NONE alive: start `dex-tasks worker --tools MODULE`; "
                            "calls wait in their queues meanwhile")
        else:
            lines.extend(f"worker   {w.get('node')} ({w.get('pool')} x{w.get('concurrency')}, "
                         f"{len(w.get('tools') or [])} tools)"
                         for w in (mine if check == "worker" else workers))
    if check in (None, "beat"):
        ago = "never" if last is None else f"{time.time() - last:.0f}s ago"
        if beat_is_late(last, interval):
            problems.append(
                f"beat     LATE  last sweep {ago}, expected every {interval:g}s (late after "
                f"{BEAT_LATE_INTERVALS}): start `dex-tasks beat`; until it runs, approval "
                "deadlines are not enforced and lost calls are not recovered")
        else:
            lines.append(f"beat     ok  last sweep {ago} (every {interval:g}s)")
    for line in lines:
        typer.echo(line)
    for line in problems:
        typer.echo(line, err=True)
    if problems:
        raise typer.Exit(1)


@app.command("calls")
def list_calls(
    session_id: str = typer.Argument(..., help="The session whose calls to list."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List a session's tool calls."""
    from dex_tasks.agent.client import DexClient
    from dex_tasks.ops.cli_render import calls_view

    client = DexClient(DexSettings())
    snapshot = client.get_agent_snapshot(session_id)
    if as_json:
        print_json(console, snapshot.model_dump_json())
        return
    console.print(calls_view(snapshot.tool_calls, console), highlight=False)


@app.command()
def show(key: str = typer.Argument(..., help="The call's idempotency key.")) -> None:
    """Print one call's record and its events as JSON."""
    from dex_tasks.agent.client import DexClient
    from dex_tasks.store.records import CallEvent

    client = DexClient(DexSettings())
    record = client.get_tool_call(key)
    events = [CallEvent.from_row(e).model_dump(mode="json")
              for e in client.store.events_for_call(key)]
    print_json(console, json.dumps({"call": record.model_dump(mode="json"), "events": events}))


@app.command()
def token(
    session_id: str | None = typer.Argument(
        None, help="The session the token is for (omit with --all-sessions)."),
    all_sessions: bool = typer.Option(
        False, "--all-sessions",
        help="An operator token, valid for every session, which also opens GET /sessions "
             "(the sessions waiting for a decision).",
    ),
    permission: Literal["view", "operate"] = typer.Option(
        "operate", "--permission",
        help="operate: read and decide approvals; view: read only (the page shows no "
             "Approve/Reject).",
    ),
    ttl: float = typer.Option(3600.0, "--ttl", help="Seconds until the token expires.",
                              callback=positive_seconds),
    approver: str | None = typer.Option(
        None, "--approver", help="The name recorded with each decision made with the token."
    ),
    grant: Annotated[list[str] | None, typer.Option(
        "--grant",
        help="A named permission the token also carries (a policy's approver_permission, "
             "e.g. refunds.approve); repeat for several.")] = None,
) -> None:
    """Print a token, signed with DEX_SECRET_KEY, for the HTTP API and the session page.

    Open the page at /sessions/SESSION_ID?token=TOKEN (an operator token: /sessions?token=TOKEN).
    """
    from dex_tasks.errors import DexError
    from dex_tasks.tokens import issue_token

    if all_sessions == (session_id is not None):
        raise typer.BadParameter("give a SESSION_ID or --all-sessions (exactly one)")
    settings = DexSettings()
    try:
        secret = settings.signing_key()
    except DexError as err:
        typer.echo(f"error: {visible(str(err))}", err=True)
        raise typer.Exit(2) from None
    try:
        typer.echo(issue_token(secret, session_id, ttl, approver,
                               permissions=(permission, *(grant or ())),
                               all_sessions=all_sessions))
    except DexError as err:
        raise typer.BadParameter(str(err)) from None


approvals_app = typer.Typer(help="List, approve and reject tool calls waiting for a person.",
                            no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")


def _cli_approver() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no login name (a container): still say it was the CLI
        return "cli"


@approvals_app.command("list")
def approvals_list(
    session_id: str | None = typer.Argument(None, help="Only this session (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the calls waiting for approval, oldest first."""
    from dex_tasks.agent.approvals import list_pending

    store = Store(DexSettings().database_url)
    store.create_all()
    pending = list_pending(store, session_id)
    if as_json:
        print_json(console, json.dumps([p.model_dump(mode="json") for p in pending]))
        return
    from dex_tasks.ops.cli_render import approvals_view

    console.print(approvals_view(pending), highlight=False)


def _decide(session_id: str, interrupt_id: str, approved: bool, message: str | None,
            approver: str | None, arguments: str | None = None,
            permissions: list[str] | None = None) -> None:
    from dex_tasks.agent.approvals import (
        ALREADY_DECIDED,
        DEADLINE_PASSED,
        UNKNOWN_INTERRUPT,
        WRONG_SESSION,
        get_interrupt,
    )
    from dex_tasks.agent.client import DexClient
    from dex_tasks.errors import DexError

    edited = None
    if arguments is not None:
        try:
            edited = json.loads(arguments)
        except ValueError as err:
            raise typer.BadParameter(f"--arguments is not JSON: {err}") from None
    with DexClient(DexSettings()) as client:
        who = approver or _cli_approver()
        try:
            decided = client.resolve_interrupt(session_id, interrupt_id, approved,
                                               rejection_message=message, approver=who,
                                               arguments=edited, permissions=permissions)
        except DexError as err:
            typer.echo(f"not decided: {err}", err=True)
            raise typer.Exit(2) from None
        if decided:
            row = get_interrupt(client.store, interrupt_id)
            call = client.get_tool_call(row.key) if row else None
            status = call.status.value if call else "?"
            if row is not None and row.decision is None:
                typer.echo(visible(f"approval counted: {row.approvals_given} of "
                                   f"{row.approvals_required} for interrupt {interrupt_id} "
                                   f"as {who}"))
                if edited is not None and call is not None and call.arguments_edit:
                    typer.echo(visible(f"{call.arguments_edit}; the approvals start again "
                                       "on the edited arguments"))
                return
            typer.echo(visible(f"decided: {'approved' if approved else 'rejected'} interrupt "
                               f"{interrupt_id} as {who}; call {call.key if call else '?'} is "
                               f"{status}"))
            if call is not None and call.arguments_edit:
                typer.echo(visible(call.arguments_edit))
            return
        reason = client.why_not_resolved(session_id, interrupt_id)
        row = get_interrupt(client.store, interrupt_id)
        if reason in (UNKNOWN_INTERRUPT, WRONG_SESSION) or row is None:
            why = f"session {session_id!r} has no interrupt {interrupt_id!r}"
        elif reason == ALREADY_DECIDED:
            by = row.decided_by or ("the deadline sweep" if row.decision == "expired" else "?")
            why = f"it was already {row.decision} by {by}"
        elif reason == DEADLINE_PASSED:
            why = "its approval deadline has passed"
        else:
            why = "it could not be decided (see the logs)"
        why = f"{why} ({reason or 'unknown'})"
        typer.echo(visible(f"not decided: {why}"), err=True)
        raise typer.Exit(1)


@approvals_app.command("approve")
def approvals_approve(
    session_id: str = typer.Argument(..., help="The call's session."),
    interrupt_id: str = typer.Argument(..., help="From `dex-tasks approvals list`."),
    approver: str | None = typer.Option(None, "--approver",
                                        help="Recorded as who decided (default: cli:$USER)."),
    arguments: str | None = typer.Option(
        None, "--arguments",
        help="Approve with these arguments instead (a JSON object, checked against the "
             "tool's schema); the call records both versions."),
    permission: Annotated[list[str] | None, typer.Option(
        "--permission",
        help="A permission the approver holds (for a policy with approver_permission).")] = None,
) -> None:
    """Approve a waiting call: it runs. Exit status 1 if this did not decide it (2 if the
    arguments or the permission were refused)."""
    _decide(session_id, interrupt_id, True, None, approver, arguments, permission)


@approvals_app.command("reject")
def approvals_reject(
    session_id: str = typer.Argument(..., help="The call's session."),
    interrupt_id: str = typer.Argument(..., help="From `dex-tasks approvals list`."),
    message: str | None = typer.Option(None, "--message", "-m",
                                       help="Why; the model reads it in the call's error."),
    approver: str | None = typer.Option(None, "--approver",
                                        help="Recorded as who decided (default: cli:$USER)."),
) -> None:
    """Reject a waiting call: it never runs. Exit status 1 if this did not decide it."""
    _decide(session_id, interrupt_id, False, message, approver)


@app.command("webhooks")
def webhooks_list(
    status: str | None = typer.Option(None, "--status",
                                      help="Only pending, delivered or failed deliveries."),
    event_id: str | None = typer.Option(None, "--event", help="Only this event id."),
    limit: int = typer.Option(50, "--limit", min=1, max=10_000),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List webhook deliveries (newest first): event, URL, status, attempts, last error."""
    from dex_tasks.ops.cli_render import webhooks_view
    from dex_tasks.store import webhooks

    store = Store(DexSettings().database_url)
    try:
        store.create_all()
        rows = webhooks.list_deliveries(store, status=status, event_id=event_id, limit=limit)
    finally:
        store.close()
    if as_json:
        console.print_json(json.dumps([{k: v for k, v in r.items() if k != "payload"}
                                       for r in rows]))
        return
    console.print(webhooks_view(rows), highlight=False)


@app.command()
def reconcile(
    session_id: str = typer.Argument(..., help="The session whose outcome_unknown calls to check."),
    tools: str | None = typer.Option(
        None, "--tools",
        help="Tool modules whose @tool.reconciler checkers to use (a,b; default: DEX_TOOLS).",
    ),
) -> None:
    """Ask the tools' checkers what happened to SESSION_ID's outcome_unknown calls and report it.

    Each answer goes into the session as a user message naming the call's key. Calls reported
    before are skipped, so running this again sends nothing new.
    """
    from dex_tasks.agent.client import DexClient
    from dex_tasks.worker.reconcilers import reconcile_with_reconcilers

    settings = DexSettings()
    tools = tool_modules(tools, settings, required=False)
    import_tool_modules(tools)
    with DexClient(settings) as client:
        result = reconcile_with_reconcilers(client.store, session_id)
    for report in result.reported:
        console.print(f"[green]reported[/green] {user_markup(report.key)}: "
                      f"{user_markup(report.text)}", highlight=False)
    for key in result.unanswered:
        console.print(f"[yellow]not known yet[/yellow] {user_markup(key)}: its checker "
                      "returned no answer", highlight=False)
    for key, error in result.failed.items():
        console.print(f"[red]checker failed[/red] {user_markup(key)}: {user_markup(error)}",
                      highlight=False)
    for key in result.no_checker:
        console.print(f"[yellow]no checker[/yellow] {user_markup(key)}: its tool has no "
                      f"@tool.reconciler in {user_markup(tools or '(no --tools given)')}",
                      highlight=False)
    if not (result.reported or result.unanswered or result.failed or result.no_checker):
        console.print(f"nothing to report: session {user_markup(repr(session_id))} has no "
                      "unreported outcome_unknown calls", highlight=False)


db_app = typer.Typer(help="The store's schema: its revision, and the migrations to head.",
                     no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Migrate DEX_DATABASE_URL's schema to this release's (head), in one transaction.

    Stop the processes of the older release first: they were written for the old schema. A
    store made by a release before migrations is recognised and upgraded too.
    """
    from dex_tasks.store.schema import upgrade

    store = Store(DexSettings().database_url)
    try:
        before, after = upgrade(store)
    finally:
        store.close()
    if before.revision == after.revision:
        typer.echo(f"{after.url}: already at head {after.head}")
    else:
        typer.echo(f"{after.url}: upgraded from {before.revision or before.state} to head "
                   f"{after.revision}")


@db_app.command("current")
def db_current() -> None:
    """Print DEX_DATABASE_URL's schema revision and whether it is head (exit status 0 at
    head, 1 otherwise)."""
    from dex_tasks.store.schema import UPGRADE_COMMAND, inspect_schema

    store = Store(DexSettings().database_url)
    try:
        status = inspect_schema(store)
    finally:
        store.close()
    state = status.state
    if state == "head":
        typer.echo(f"{status.url}: {status.revision} (head)")
        return
    if state == "empty":
        line = (f"no schema yet (an empty database: the first worker, beat, API or client to "
                f"start migrates it to head {status.head}, or run `{UPGRADE_COMMAND}`)")
    elif state == "unversioned":
        line = (f"no revision recorded (tables of a release before migrations; head is "
                f"{status.head}): run `{UPGRADE_COMMAND}`")
    elif state == "behind":
        line = f"{status.revision} (behind head {status.head}): run `{UPGRADE_COMMAND}`"
    else:
        line = (f"{status.revision} (not a revision this dex-tasks knows; its head is "
                f"{status.head}): a newer release migrated it")
    typer.echo(f"{status.url}: {line}")
    raise typer.Exit(1)


def _check_age(value: str) -> str:
    """Refuse a bad --older-than before anything connects (typer names the option)."""
    from dex_tasks.errors import InvalidArgumentError
    from dex_tasks.store.prune import AGE_RULE, parse_age

    try:
        parse_age(value)
    except InvalidArgumentError:
        raise typer.BadParameter(f"{AGE_RULE}; got {value!r}") from None
    return value


@app.command()
def prune(
    older_than: str = typer.Option(
        ..., "--older-than",
        help="How long ago a call must have finished: 30d, 12h or 90m (days, hours, minutes).",
        callback=_check_age,
    ),
    batch: int | None = typer.Option(
        None, "--batch", min=1,
        help="Calls (or messages) deleted per transaction [default: DEX_PRUNE_BATCH, 1000].",
    ),
) -> None:
    """Delete finished calls older than --older-than, with their events, interrupts and
    transcript messages, in short transactions (workers keep running).

    Kept: outcome_unknown calls no user message has reported yet, calls whose turn is still
    open, and the messages of sessions with a call still open.
    """
    from dex_tasks.store.prune import parse_age
    from dex_tasks.store.prune import prune as run_prune

    seconds = parse_age(older_than)
    settings = DexSettings()
    store = Store(settings.database_url)
    try:
        store.create_all()
        result = run_prune(store, seconds, batch=batch or settings.prune_batch,
                           on_pruned=_forget_claims(settings))
    finally:
        store.close()
    typer.echo(
        f"deleted {result.calls} calls finished before "
        f"{datetime.fromtimestamp(result.cutoff, tz=UTC):%Y-%m-%d %H:%M:%S} UTC "
        f"({result.events} events, {result.interrupts} interrupts, {result.tool_messages} tool "
        f"messages) and {result.messages} user and assistant messages, in {result.batches} "
        f"transactions (the longest {result.longest_batch_seconds * 1000:.0f} ms)")
    if result.kept_unreported or result.kept_open_turn:
        typer.echo(f"kept {result.kept_unreported} outcome_unknown calls not yet reported and "
                   f"{result.kept_open_turn} calls of turns still open")


def _forget_claims(settings: DexSettings) -> Callable[[list[str]], None]:
    """What prune does with the keys of the single-attempt calls it deleted: delete their Redis
    claims (best effort: unreachable Redis only keeps them until their TTL; the tombstones
    in the store are what keeps a replay from running)."""
    from dex_tasks.broker.redis_clients import redis_client
    from dex_tasks.worker import claims

    client = redis_client(settings, socket_timeout=5)

    def forget(keys: list[str]) -> None:
        try:
            claims.forget(client, keys)
        except Exception as err:  # noqa: BLE001 - the claims expire on their own
            logging.getLogger("dex_tasks").warning(
                "could not delete the Redis claims of pruned calls: %s", err,
                extra={"action": "prune_claims_error", "count": len(keys)})

    return forget


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script.

    A :class:`DexError` (a call that does not exist, a setting that is wrong, a store that
    cannot be reached) is the user's to fix, not a bug: one line on stderr, no traceback, exit
    status 2 for configuration and 1 otherwise.
    """
    try:
        app(args=argv)
    except DexError as err:
        typer.echo(f"error: {visible(str(err))}", err=True)
        sys.exit(2 if isinstance(err, ConfigurationError) else 1)


if __name__ == "__main__":
    main()
