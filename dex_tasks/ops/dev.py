"""``dex-tasks dev --tools MODULE``: a developer's own stack in one command.

An embedded Redis (or ``DEX_REDIS_URL``), a SQLite store in the current folder (or
``DEX_DATABASE_URL``), and ``dex-tasks worker`` for the developer's tool modules, ``beat`` and
``api`` as subprocesses (:class:`dex_tasks.ops.embedded.Stack`, as the demo runs them). It prints
the session pages' address with an operator token and the exports an agent process needs, then
watches the tool modules' files: a change restarts the worker, which publishes the new catalog.
A worker that cannot import the modules (a syntax error) is reported in its own one line, and
started again once a file changes.

Ctrl-C (or SIGTERM, SIGHUP) stops every process it started and removes its temporary folder
(Redis' and the processes' logs); the store stays, in the current folder, for the next run.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console

from dex_tasks.errors import ConfigurationError
from dex_tasks.logs import redact
from dex_tasks.ops.embedded import (
    Interrupted,
    Stack,
    StackError,
    settings_from,
    signals_as_interrupts,
    signals_ignored,
)
from dex_tasks.ops.procutil import free_port
from dex_tasks.settings import DexSettings, absolute_sqlite_url

POLL_SECONDS = 0.5
"""How often the tool modules' files are checked for a change."""

TOKEN_TTL_SECONDS = 7 * 24 * 3600.0
"""The printed operator token's lifetime: a developer's week."""


def module_files(modules: Iterable[str], cwd: Path) -> list[Path]:
    """The files to watch for ``modules``: a module's own folder's ``*.py`` (the helpers it
    imports next to it), a package's whole tree. Found without importing the modules (a
    syntax error must not stop the watch); a module that does not exist is a
    :class:`ConfigurationError` naming it."""
    if str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))
    files: set[Path] = set()
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            raise ConfigurationError(
                f"cannot find tool module {name!r} from {cwd} (run `dex-tasks dev` in the "
                "folder that holds it, or check --tools)")
        origin = Path(spec.origin)
        if spec.submodule_search_locations:  # a package: everything under it
            files.update(origin.parent.rglob("*.py"))
        else:
            files.update(origin.parent.glob("*.py"))
    return sorted(files)


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:``port`` now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def snapshot(files: Iterable[Path]) -> dict[Path, int]:
    """Each file's modification time (a deleted file is missing from the answer)."""
    times = {}
    for path in files:
        try:
            times[path] = path.stat().st_mtime_ns
        except OSError:
            continue
    return times


def build_env(base: dict[str, str], workdir: Path, cwd: Path) -> tuple[dict[str, str], list[str]]:
    """The processes' environment, and the settings of the user's own it keeps."""
    env = dict(base)
    own = [name for name in ("DEX_REDIS_URL", "DEX_DATABASE_URL") if env.get(name)]
    # Absolute, so that the agent's terminal finds the same file wherever it runs.
    env["DEX_DATABASE_URL"] = absolute_sqlite_url(
        env.get("DEX_DATABASE_URL") or "sqlite:///dex.db", cwd)
    env.setdefault("DEX_STATE_DIR", str(workdir / "state"))
    if not env.get("DEX_SECRET_KEY"):
        env["DEX_SECRET_KEY"] = secrets.token_urlsafe(32)
    env["PYTHONUNBUFFERED"] = "1"
    return env, own


class DevStack:
    """One ``dex-tasks dev`` run: start, print, watch, restart, stop."""

    def __init__(self, console: Console, modules: str, *, port: int, concurrency: int,
                 cwd: Path | None = None) -> None:
        self.console = console
        self.modules = [m.strip() for m in modules.split(",") if m.strip()]
        if not self.modules:
            raise ConfigurationError("no tool modules: pass --tools MODULE[,MODULE]")
        self.cwd = (cwd or Path.cwd()).resolve()
        self.files = module_files(self.modules, self.cwd)  # a module that is not there: now
        self.watched: dict[Path, int] = {}
        self.worker_down = False
        self.port = port
        self.concurrency = concurrency
        self.workdir = Path(tempfile.mkdtemp(prefix="dex-dev-"))
        env, self.own = build_env(dict(os.environ), self.workdir, self.cwd)
        self.stack = Stack(self.workdir, env, settings_from(env), cwd=self.cwd)

    def run(self) -> int:
        """Until Ctrl-C (0), or until beat or the API stops by itself (1)."""
        code = 0
        with signals_as_interrupts():
            try:
                self._start()
                self._watch()
            except (KeyboardInterrupt, Interrupted):
                pass
            except StackError as err:
                self.console.print(f"[red]the dev stack failed:[/] {err}", highlight=False)
                code = 1
            finally:
                with signals_ignored():
                    self.console.print("stopping...")
                    self.stack.stop()
        if code == 0:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.console.print("stopped; nothing left running.")
        else:
            self.console.print(f"logs kept in {self.workdir}", highlight=False)
        return code

    def _start(self) -> None:
        stack, console = self.stack, self.console
        console.print(f"[bold]dex-tasks dev[/]: {', '.join(self.modules)}", highlight=False)
        if "DEX_REDIS_URL" in self.own:
            console.print(f"  Redis   {redact(stack.env['DEX_REDIS_URL'])} (yours)",
                          highlight=False)
        else:
            with console.status("starting Redis..."):
                server = stack.start_redis()
            console.print(f"  Redis   {server.url} (embedded, redis-server from "
                          f"{server.origin})", highlight=False)
        console.print(f"  store   {redact(stack.env['DEX_DATABASE_URL'])}", highlight=False)
        port = self.port if self.port and port_free(self.port) else free_port()
        stack.api_url = f"http://127.0.0.1:{port}"
        with console.status("starting the worker, beat and the API..."):
            stack.start("beat", ["beat"])
            stack.start("api", ["api", "--host", "127.0.0.1", "--port", str(port)])
            self.watched = snapshot(self.files)  # a save from now on restarts it
            # INFO: a developer sees a line per call, and the stack waits for the worker's
            # "ready." line (WARNING, the worker's default, prints none).
            stack.start("worker", ["worker", "--tools", ",".join(self.modules),
                                   "-c", str(self.concurrency), "-l", "INFO"])
            stack.wait_ready(names=("beat", "api"))
            worker_up = self._worker_ready()
        console.print(f"  logs    {self.workdir}", highlight=False)
        if worker_up:
            self._print_tools()
        self._print_next_steps()

    def _worker_ready(self, timeout: float = 60.0) -> bool:
        """Wait for the worker; False (its error printed) if it exited, e.g. a syntax error
        in a tool module: the watch starts it again once a file changes."""
        try:
            self.stack.wait_ready(timeout, names=("worker",))
            return True
        except StackError:
            if self.stack.procs["worker"].alive():
                raise
            self._report_worker_exit()
            return False

    def _report_worker_exit(self) -> None:
        """The worker's last line (a tool module's error is one), and what to do."""
        self.worker_down = True
        lines = [ln for ln in self.stack.procs["worker"].log().splitlines() if ln.strip()]
        self.console.print(f"the worker stopped: {lines[-1] if lines else ''}",
                           highlight=False, soft_wrap=True, markup=False)
        self.console.print("  fix the tool module and save it: the worker starts again.")

    def _print_tools(self) -> None:
        from dex_tasks.store import Store

        store = Store(self.stack.settings.database_url)
        try:
            names = [row.name for row in store.list_catalog()]
        finally:
            store.close()
        self.console.print(f"  worker  ready; tools published: {', '.join(names) or '(none)'}",
                           highlight=False, soft_wrap=True)

    def _print_next_steps(self) -> None:
        from dex_tasks.tokens import issue_token

        settings: DexSettings = self.stack.settings
        token = issue_token(settings.signing_key(), None, TOKEN_TTL_SECONDS, "you (dev)",
                            all_sessions=True)
        env = self.stack.env
        # The secret key too, for `dex-tasks token` there, unless it is the user's own (then
        # that terminal has it already, and it is not printed).
        names = ["DEX_REDIS_URL", "DEX_DATABASE_URL"]
        names += [] if "DEX_SECRET_KEY" in os.environ else ["DEX_SECRET_KEY"]
        exports = " ".join(f"{name}={shlex.quote(env[name])}" for name in names)
        self.console.print(
            f"\nSessions and their approvals (an operator token, valid 7 days):\n"
            f"  {self.stack.api_url}/sessions?token={token}\n"
            f"API docs: {self.stack.api_url}/docs\n\n"
            f"In the agent's terminal (with this environment activated), then run the agent:\n"
            f"  export {exports}\n\n"
            f"Watching {', '.join(self.modules)}: a saved change restarts the worker. "
            "Press Ctrl-C to stop everything.", highlight=False, soft_wrap=True, markup=False)

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            for name in ("beat", "api"):
                proc = self.stack.procs[name]
                if not proc.alive():
                    raise StackError(f"dex-tasks {name} exited:\n{proc.tail()}")
            if not self.worker_down and not self.stack.procs["worker"].alive():
                self._report_worker_exit()  # once; the next saved change starts it again
            try:
                files = module_files(self.modules, self.cwd)
            except ConfigurationError as err:  # renamed or deleted: say so, keep watching
                files = []
                if self.watched:
                    self.console.print(str(err), highlight=False, markup=False)
            now = snapshot(files)
            if now == self.watched:
                continue
            changed = sorted({p.name for p in now.keys() ^ self.watched.keys()}
                             | {p.name for p in now.keys() & self.watched.keys()
                                if now[p] != self.watched[p]})
            self.watched = now
            if not now:
                continue
            self.console.print(f"{', '.join(changed)} changed: restarting the worker...",
                               highlight=False)
            self.stack.restart("worker")
            self.worker_down = False
            if self._worker_ready():
                self._print_tools()


def run(modules: str, *, port: int = 0, concurrency: int = 2,
        console: Console | None = None) -> int:
    """Run the dev stack until Ctrl-C; the process exit code."""
    return DevStack(console or Console(), modules, port=port, concurrency=concurrency).run()
