"""What the ``dex-tasks`` commands share: the console, option checks, tool imports, and the
wait for a store that is not answering yet at start-up."""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console

from dex_tasks.errors import ConfigurationError, StoreUnavailableError
from dex_tasks.logs import FORMATS
from dex_tasks.settings import DexSettings

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
    ``wait`` seconds; then the store's error, which the CLI prints in one line. Each try that
    failed is one WARNING line with the store's URL (no password), the cause and how long
    it has been.

    What waiting cannot fix is not waited for: a refusal (a wrong password, a database that
    does not exist, a pooler refusing a parameter: :class:`StoreRefusedError`), an
    out-of-date schema or a bad setting is raised at once.
    """
    started = time.monotonic()
    deadline = started + wait
    pause = 0.5
    while True:
        try:
            return step()
        except StoreUnavailableError as err:
            if isinstance(err, ConfigurationError) or time.monotonic() + pause > deadline:
                raise
            elapsed = time.monotonic() - started
            logging.getLogger("dex_tasks").warning(
                f"the store is not answering yet ({' '.join(str(err).split())[:300]}); trying "
                f"again in {pause:.1f} s (waiting for {elapsed:.0f} s)",
                extra={"action": "startup_store_wait", "waiting_for": f"{elapsed:.0f}s"})
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def secret_or_none(settings: DexSettings) -> str | None:
    """The signing key for log redaction, if one is set (workers and beat need none)."""
    return settings.secret_key.get_secret_value() if settings.secret_key else None


def import_tool_modules(modules: str) -> list[str]:
    """Import ``a.b,c`` the way ``celery -A`` does, with the current directory on the path.

    A module that cannot be found is a :class:`ConfigurationError` naming it (a typo in
    ``--tools``, or a dependency of the tools that is not installed), and so is a syntax error
    (one line: the file, the line and the error, as an editor shows it); any other error in a
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
        except SyntaxError as err:
            # Python's traceback for it is 50 lines of importlib; the error is in one place.
            raise ConfigurationError(
                f"tool module {name!r} does not compile: {err.filename}:{err.lineno}: "
                f"{err.msg}") from None
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
