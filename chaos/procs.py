"""The processes the harness runs and kills: its own redis-server, workers and beat.

Every process is started in its own session and stopped by its PID (never by name), so a
harness run touches nothing it did not start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from dex_tasks.ops.procutil import children_of, dex_command, free_port, wait_until
from dex_tasks.ops.procutil import redis_pings as _pings

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it is true; ``TimeoutError`` naming ``what`` after ``timeout``."""
    wait_until(predicate, timeout, what, 0.05, error=TimeoutError)


def signal_quietly(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False if the process is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class RedisProcess:
    """A private ``redis-server`` with AOF on (``appendfsync everysec``), as in production.

    ``crash_and_restart`` SIGKILLs it and starts it again on the same port and directory, so
    the server reloads its append-only file the way a crashed production Redis does (and may
    lose up to a second of writes, which the design must survive).
    """

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.dir = directory
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install Redis to run the harness")
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                 "--maxmemory-policy", "noeviction"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            wait_for(lambda: _pings(client), 20, f"redis-server on port {self.port}")
        finally:
            client.close()
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: no final AOF rewrite, no goodbye to clients)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@dataclass(frozen=True)
class WorkerSpec:
    """How one worker of the cluster runs: its pool, its slots, the tools it serves."""

    pool: str = "prefork"
    concurrency: int = 2
    serve: str | None = None  # comma-separated tool names; None: every imported tool

    def args(self, tools: str) -> list[str]:
        """The ``dex-tasks worker`` arguments of this spec."""
        return ["worker", "--tools", tools, "-c", str(self.concurrency), "--pool", self.pool,
                *(["--serve", self.serve] if self.serve else []), "--loglevel", "INFO"]

    def describe(self) -> str:
        return f"{self.pool} -c {self.concurrency} serving {self.serve or 'every tool'}"


class DexProcess:
    """A ``dex-tasks worker`` or ``dex-tasks beat`` subprocess, its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path,
                 spec: WorkerSpec | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.spec = spec
        self._ready = False
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*dex_command(), *args], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ready(self) -> bool:
        """True once a worker logged that it is ready (beat: once it started); raises if the
        process exited before that."""
        if not self._ready:
            if not self.alive:
                raise RuntimeError(f"{' '.join(self.args)} exited early:\n{self.log()[-3000:]}")
            marker = " ready." if self.args[0] == "worker" else "beat: Starting"
            self._ready = marker in self.log()
        return self._ready

    @property
    def serving(self) -> bool:
        """Alive and ready (never raises)."""
        try:
            return self.alive and self.ready()
        except RuntimeError:
            return False

    def children(self) -> list[int]:
        return children_of(self.pid) if self.alive else []

    def kill_all(self, children: list[int] | None = None) -> list[int]:
        """SIGKILL the main process and its children (a machine that vanishes); returns PIDs."""
        kids = self.children() if children is None else children
        signal_quietly(self.pid, signal.SIGKILL)
        for kid in kids:
            signal_quietly(kid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return [self.pid, *kids]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL whatever is left."""
        kids = self.children()
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_all(kids)
        for kid in kids:
            signal_quietly(kid, signal.SIGKILL)


class Cluster:
    """Everything a run starts: Redis, workers and beat, all writing logs to ``workdir``.

    Workers take the ``specs`` in turn (the first worker the first spec, and so on, cycling),
    so a run can mix pools and tool sets; a replacement takes the spec of the worker it
    replaces.
    """

    def __init__(self, workdir: Path, tools: str, specs: list[WorkerSpec]) -> None:
        self.workdir = workdir
        self.tools = tools
        self.specs = specs
        self.redis = RedisProcess(workdir / "redis")
        self.workers: list[DexProcess] = []
        self.beat: DexProcess | None = None
        self.env: dict[str, str] = {}
        self.started = 0

    def start_worker(self, spec: WorkerSpec | None = None) -> DexProcess:
        """Start one more worker, with ``spec`` or the next spec in turn (it takes a few
        seconds to become ready)."""
        spec = spec or self.specs[len(self.workers) % len(self.specs)]
        self.started += 1
        worker = DexProcess(spec.args(self.tools), self.env,
                            self.workdir / f"worker-{self.started}.log", spec)
        self.workers.append(worker)
        return worker

    def start_beat(self) -> DexProcess:
        """Start beat (after SIGKILLing the previous one, if any)."""
        if self.beat is not None:
            self.beat.kill_all()
        self.started += 1
        self.beat = DexProcess(["beat", "--loglevel", "INFO"], self.env,
                               self.workdir / f"beat-{self.started}.log")
        return self.beat

    def stop(self) -> None:
        """Stop every process, Redis last."""
        for proc in [*self.workers, *([self.beat] if self.beat else [])]:
            proc.stop(timeout=10)
        self.redis.kill()
