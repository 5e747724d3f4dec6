"""Test helpers: waiting on conditions, private servers, and real worker processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition",
               interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def started_pid(ledger_path: Path, key: str, attempt: int = 1, timeout: float = 20.0) -> int:
    """Wait until ``key``'s attempt has reached the tool; the PID of the child running it."""
    from workers import ledger

    def find() -> int | None:
        for entry in ledger.read(ledger_path):
            if entry["key"] == key and entry["attempt"] == attempt:
                return int(entry["pid"])
        return None

    return wait_until(find, timeout, f"{key} attempt {attempt} to start")


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RedisServer:
    """A private ``redis-server`` on a free port, stopped by its PID."""

    port: int
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dex-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", self.dir, "--databases", "64", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_until(lambda: _pings(client), 10, f"redis-server on port {self.port}")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def children_of(pid: int) -> list[int]:
    """Direct child PIDs of ``pid`` (Linux /proc)."""
    result: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    if not task_dir.exists():
        return result
    for task in task_dir.iterdir():
        try:
            result += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return result


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@dataclass
class WorkerProcess:
    """One ``dex-tasks worker`` subprocess."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.log()}")
            return " ready." in self.log()

        wait_until(ready, timeout, "the worker to be ready")
        return self

    def children(self) -> list[int]:
        return children_of(self.pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL the main process and every child: a machine that disappears."""
        kids = self.children()
        self.kill(signal.SIGKILL)
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def discard(self) -> None:
        """SIGKILL the worker's whole process group: test teardown needs no warm shutdown."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for kid in self.children():
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), as an operator would stop a worker."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill_all()
        for kid in self.children():
            try:
                os.kill(kid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def dex_command() -> list[str]:
    """How to run the ``dex-tasks`` console script of this environment."""
    script = Path(sys.executable).parent / "dex-tasks"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dex_tasks.cli"]


def start_process(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``dex-tasks ARGS`` in the repo root, its output in ``log_path``."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [*dex_command(), *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
