"""The ``dex-tasks`` command. Thin: it parses, builds settings, and calls the library."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import tempfile

import typer
from rich.console import Console
from rich.table import Table

from dex_tasks import catalog
from dex_tasks.celery_app import RETRYING_QUEUE, SINGLE_ATTEMPT_QUEUE, create_app
from dex_tasks.registry import local_tools
from dex_tasks.settings import DexSettings, settings_help
from dex_tasks.store import Store

app = typer.Typer(
    help="Run AI agents' tool calls as Celery tasks.\n\nConfiguration (environment):\n\n"
    + settings_help().replace("\n", "\n\n"),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()


def import_tool_modules(modules: str) -> list[str]:
    """Import ``a.b,c`` the way ``celery -A`` does, with the current directory on the path."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    names = [m.strip() for m in modules.split(",") if m.strip()]
    for name in names:
        importlib.import_module(name)
    return names


@app.command()
def worker(
    tools: str = typer.Option(..., "--tools", help="Tool modules to import, comma-separated."),
    concurrency: int = typer.Option(2, "-c", "--concurrency", help="Worker processes."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
) -> None:
    """Run a prefork Celery worker for the tools in MODULE[,MODULE]."""
    settings = DexSettings()
    import_tool_modules(tools)
    store = Store(settings.database_url)
    store.create_all()
    count = catalog.publish(store, local_tools().values())
    store.dispose()
    logging.basicConfig(level=loglevel.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("dex_tasks").info("catalog published", extra={"action": "catalog_published",
                                                                     "tools": count})
    celery = create_app(settings)
    from dex_tasks import hooks

    hooks.install(celery)
    celery.worker_main([
        "worker",
        "-Q", f"{RETRYING_QUEUE},{SINGLE_ATTEMPT_QUEUE}",
        "-c", str(concurrency),
        "-P", "prefork",
        # A unique node name per process: leases are owned by "<node>:<child pid>".
        "-n", f"dex-{os.getpid()}@%h",
        "--loglevel", loglevel,
        "--without-gossip", "--without-mingle",
    ])


@app.command()
def beat(loglevel: str = typer.Option("INFO", "--loglevel", "-l")) -> None:
    """Run Celery beat with the schedule from beat_schedule.py."""
    import beat_schedule

    settings = DexSettings()
    celery = create_app(settings)
    celery.conf.beat_schedule = beat_schedule.build(settings)
    state = os.path.join(tempfile.gettempdir(), f"dex-beat-{os.getuid()}-{os.getpid()}")
    celery.start(["beat", "--loglevel", loglevel, "--schedule", state])


@app.command()
def sweep() -> None:
    """Run every periodic job of beat_schedule.py once, now."""
    from dex_tasks.execution import runtime
    from dex_tasks.sweeps import run_all

    settings = DexSettings()
    rt = runtime(create_app(settings))
    rt.store.create_all()
    console.print_json(json.dumps(run_all(rt)))


@app.command("calls")
def list_calls(
    session_id: str = typer.Argument(..., help="The session whose calls to list."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List a session's tool calls."""
    from dex_tasks.client import DexClient

    client = DexClient(DexSettings())
    snapshot = client.get_agent_snapshot(session_id)
    if as_json:
        console.print_json(snapshot.model_dump_json())
        return
    table = Table("key", "tool", "effect", "status", "attempts", "error")
    for call in snapshot.tool_calls:
        table.add_row(call.key, call.tool, call.effect.value, call.status.value,
                      str(call.attempts), (call.error or "")[:80])
    console.print(table)


@app.command()
def show(key: str = typer.Argument(..., help="The call's idempotency key.")) -> None:
    """Print one call's record and its events as JSON."""
    from dex_tasks.client import DexClient
    from dex_tasks.records import CallEvent

    client = DexClient(DexSettings())
    record = client.get_tool_call(key)
    events = [CallEvent.from_row(e).model_dump(mode="json")
              for e in client.store.events_for_call(key)]
    console.print_json(json.dumps({"call": record.model_dump(mode="json"), "events": events}))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script."""
    app(args=argv)


if __name__ == "__main__":
    main()
