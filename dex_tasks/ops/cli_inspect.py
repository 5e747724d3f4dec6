"""The ``dex-tasks`` commands that look: ``status`` (health), ``calls``, ``show``,
``webhooks``, and ``reconcile`` (the tools' checkers asked about outcome_unknown calls)."""

from __future__ import annotations

import json
import time

import typer

from dex_tasks.errors import DexError
from dex_tasks.ops.cli_common import console, import_tool_modules, tool_modules
from dex_tasks.ops.cli_render import print_json, user_markup
from dex_tasks.settings import DexSettings
from dex_tasks.store import Store

commands = typer.Typer()


@commands.command()
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


@commands.command("calls")
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


@commands.command()
def show(key: str = typer.Argument(..., help="The call's idempotency key.")) -> None:
    """Print one call's record and its events as JSON."""
    from dex_tasks.agent.client import DexClient
    from dex_tasks.store.records import CallEvent

    client = DexClient(DexSettings())
    record = client.get_tool_call(key)
    events = [CallEvent.from_row(e).model_dump(mode="json")
              for e in client.store.events_for_call(key)]
    print_json(console, json.dumps({"call": record.model_dump(mode="json"), "events": events}))


@commands.command("webhooks")
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


@commands.command()
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
