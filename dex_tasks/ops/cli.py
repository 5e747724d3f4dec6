"""The ``dex-tasks`` command. Thin: it parses, builds settings, and calls the library.

Its commands live by group, one module each: ``cli_processes`` (worker, beat, api, mcp, demo,
sweep), ``cli_inspect`` (status, calls, show, webhooks, reconcile), ``cli_approvals`` (token,
approvals) and ``cli_store`` (db, prune); ``cli_common`` holds what they share. This module
puts them together and is the console script's entry point.
"""

from __future__ import annotations

import sys

import redis
import typer

from dex_tasks.broker.preflight import refusal, transient
from dex_tasks.broker.redis_clients import safe_url
from dex_tasks.errors import ConfigurationError, DexError
from dex_tasks.logs import visible
from dex_tasks.ops import cli_approvals, cli_inspect, cli_processes, cli_store
from dex_tasks.ops.cli_common import until_store_answers
from dex_tasks.ops.tracing_setup import configure_from_env
from dex_tasks.settings import DexSettings, settings_lines

__all__ = ["app", "main", "until_store_answers"]

app = typer.Typer(
    help="Run AI agents' tool calls as Celery tasks.\n\nConfigured by DEX_* environment "
    "variables: `dex-tasks config` lists them with their values.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
config_commands = typer.Typer()


@config_commands.command()
def config() -> None:
    """List every DEX_* setting: its value here (secrets only as set or not) and what it is."""
    settings = DexSettings()  # a wrong value: one line per setting (main)
    for line in settings_lines(settings):
        typer.echo(line)


for group in (cli_processes, cli_inspect, cli_approvals, cli_store):
    app.add_typer(group.commands)
app.add_typer(config_commands)  # last: --help lists the commands people run first


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script.

    A :class:`DexError` (a call that does not exist, a setting that is wrong, a store that
    cannot be reached) is the user's to fix, not a bug: one line on stderr, no traceback, exit
    status 2 for configuration and 1 otherwise.
    """
    try:
        # OpenTelemetry from the OTEL_* variables, when they ask for traces (ops/tracing_setup.py).
        configure_from_env(next(iter(argv if argv is not None else sys.argv[1:]), "cli"))
        app(args=argv)
    except DexError as err:
        typer.echo(f"error: {visible(str(err))}", err=True)
        sys.exit(2 if isinstance(err, ConfigurationError) else 1)
    except KeyboardInterrupt:
        # Ctrl-C while a worker or beat waits for Redis or the store: no traceback.
        sys.exit(130)
    except redis.RedisError as err:
        # A command that reached Redis itself (sweep, prune): a refusal is the user's to fix
        # (one line naming it, as DexClient's BrokerRefusedError), an outage too.
        refused = not transient(err)
        try:
            url = DexSettings().redis_url
        except DexError:
            url = "DEX_REDIS_URL"
        text = (refusal(err, url) if refused else
                f"Redis at {safe_url(url)} is not answering: {' '.join(str(err).split())}")
        typer.echo(f"error: {visible(text)}", err=True)
        sys.exit(2 if refused else 1)


if __name__ == "__main__":
    main()
