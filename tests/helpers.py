"""Test helpers: waiting on conditions, private servers, and real worker processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis

from dex_tasks import AgentSnapshot, MessageRole, SessionMessage

# Re-exported for the tests, which import them from here.
from dex_tasks.ops.procutil import children_of as children_of
from dex_tasks.ops.procutil import dex_command as dex_command
from dex_tasks.ops.procutil import free_port as free_port
from dex_tasks.ops.procutil import pid_alive as pid_alive
from dex_tasks.ops.procutil import redis_pings as _pings
from dex_tasks.ops.procutil import wait_until as wait_until
from dex_tasks.store import Store

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@contextmanager
def open_store(url: str) -> Iterator[Store]:
    """A store on ``url`` with its tables created, closed (its held connections returned) at
    the end: the body of the tests' store fixtures."""
    store = Store(url)
    store.create_all()
    try:
        yield store
    finally:
        store.close()


def started_pid(ledger_path: Path, key: str, attempt: int = 1, timeout: float = 20.0) -> int:
    """Wait until ``key``'s attempt has reached the tool; the PID of the child running it."""
    from workers import ledger

    def find() -> int | None:
        for entry in ledger.read(ledger_path):
            if entry["key"] == key and entry["attempt"] == attempt:
                return int(entry["pid"])
        return None

    return wait_until(find, timeout, f"{key} attempt {attempt} to start")


@dataclass
class RedisServer:
    """A private ``redis-server`` on a free port, stopped by its PID."""

    port: int
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dex-redis-"))
    # The default user's password (--requirepass), when the server should have one.
    password: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", self.dir, "--databases", "64",
             *(["--requirepass", self.password] if self.password else []), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, password=self.password)
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


def race_in_processes(target: Callable[..., None], arguments: list[tuple[Any, ...]],
                      timeout: float = 90.0) -> list[Any]:
    """Run ``target(*args, go, out)`` in one process per ``args``, all let go at the same
    moment (``go.wait()``); what each put on ``out``, in the order they finished.

    Fork is much cheaper than spawn; it is only unsafe (and warned about) when this process has
    threads. Every process must exit 0.
    """
    ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, go, out)) for args in arguments]
    for proc in procs:
        proc.start()
    go.set()
    results = [out.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return results


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


@contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free port in a thread of this process; yields its URL.

    For what needs a real socket: event streams that never end, raw requests whose body is
    never sent."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 10, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def user_messages(snapshot: AgentSnapshot) -> list[SessionMessage]:
    """The user messages of a session's transcript, oldest first."""
    return [m for m in snapshot.messages if m.role is MessageRole.USER]


def tool_messages(snapshot: AgentSnapshot) -> list[SessionMessage]:
    """The tool messages of a session's transcript, oldest first."""
    return [m for m in snapshot.messages if m.role is MessageRole.TOOL]


@dataclass
class TcpProxy:
    """``tests/tcp_proxy.py`` run as its own process in front of ``target`` (host:port).

    ``cut(seconds)`` closes every open connection and refuses new ones for that long (a
    database restart as its clients see it); ``reset()`` only closes them; ``lose_commit_reply``
    makes the next COMMIT take effect while its client loses the connection before the answer,
    ``lose_reply`` the same for the next statement that holds a text (one in autocommit).
    """

    target: str
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    control_port: int = 0

    def start(self) -> TcpProxy:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.tcp_proxy", "--target", self.target],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        words = self.proc.stdout.readline().split()
        if len(words) != 4 or words[0] != "listening":
            self.stop()
            raise RuntimeError(f"the TCP proxy did not start: {words}")
        self.port, self.control_port = int(words[1]), int(words[3])
        return self

    def url(self, database_url: str) -> str:
        """``database_url`` pointed at the proxy instead of the server."""
        from sqlalchemy.engine import make_url

        url = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return url.render_as_string(hide_password=False)

    def command(self, line: str) -> str:
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=10) as conn:
            conn.sendall(line.encode() + b"\n")
            reply = conn.makefile().readline().strip()
        if not reply.startswith(("ok", "open")):
            raise RuntimeError(f"TCP proxy: {line!r} -> {reply!r}")
        return reply

    def cut(self, seconds: float) -> int:
        """Close every open connection and refuse new ones for ``seconds``; how many closed."""
        return int(self.command(f"cut {seconds}").split()[1])

    def reset(self) -> int:
        """Close every open connection (new ones are accepted); how many closed."""
        return int(self.command("reset").split()[1])

    def lose_commit_reply(self) -> None:
        """The next COMMIT commits, but its client loses the connection before the answer."""
        self.command("lose-commit-reply")

    def lose_commit(self) -> None:
        """The next COMMIT never reaches the server; its client loses the connection."""
        self.command("lose-commit")

    def lose_reply(self, text: str, *, skip: int = 0) -> None:
        """The next statement whose message holds ``text`` (a call's key, say), after ``skip``
        such went through, runs and commits (autocommit), but its client loses the connection
        before the answer."""
        self.command(f"lose-reply {skip} {text}")

    def lose_statement(self, text: str, *, skip: int = 0) -> None:
        """Like :meth:`lose_reply`, but the statement never reaches the server."""
        self.command(f"lose-statement {skip} {text}")

    def stats(self) -> dict[str, int]:
        words = self.command("stats").split()
        return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


@dataclass
class Sweeper:
    """``tests/sweeper.py`` as its own process: sweep jobs every 0.2 s (default: the reaper
    and the republisher)."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, env: dict[str, str], log_path: Path, *jobs: str) -> Sweeper:
        with open(log_path, "ab") as out, open(log_path.with_suffix(".err"), "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "tests.sweeper", *jobs], cwd=ROOT,
                                    env=env, stdout=out, stderr=err, start_new_session=True)
        sweeper = cls(proc, log_path)
        wait_until(lambda: sweeper._lines() or sweeper._exited(), 30, "the sweeper to start")
        return sweeper

    def _exited(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the sweeper exited with {self.proc.returncode}")
        return False

    def _lines(self) -> list[dict[str, float]]:
        text = self.log_path.read_text() if self.log_path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def log(self) -> str:
        """What the sweeper logged (its standard error)."""
        path = self.log_path.with_suffix(".err")
        return path.read_text(errors="replace") if path.exists() else ""

    def clock(self) -> float:
        """The sweeper's own ``time.time()`` when it started."""
        return self._lines()[0]["clock"]

    def rounds(self) -> list[int]:
        """How many calls each round moved."""
        return [int(line["moved"]) for line in self._lines() if "moved" in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def faketime_env(offset: str) -> dict[str, str]:
    """Environment that runs a process with its clock ``offset`` from the machine's ("+10s",
    "-10s"): Debian's libfaketime, preloaded. It moves the monotonic clock by the same offset
    (intervals stay true; leaving it alone makes libfaketime's ``clock_nanosleep`` fail)."""
    import glob

    import pytest

    libraries = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not libraries:
        message = "libfaketime is not installed (apt-get install faketime)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return {"LD_PRELOAD": libraries[0], "FAKETIME": offset}


def calls_on_every_path(client: Any, name: str, sleep: float) -> list[str]:
    """Start a read, an idempotent write and a single-attempt charge of the example tools
    whose tools take ``sleep`` seconds; their keys. ``client`` is a ``DexClient``."""
    return [
        client.call_tool(session_id="s", turn_id="t", tool_call_id=f"read-{name}",
                         tool="lookup_order",
                         arguments={"order_id": "1001", "sleep": sleep}).key,
        client.call_tool(session_id="s", turn_id="t", tool_call_id=f"write-{name}",
                         tool="update_address",
                         arguments={"order_id": "1001", "address": "1 Elm St",
                                    "sleep": sleep}).key,
        client.call_tool(session_id="s", turn_id="t", tool_call_id=f"charge-{name}",
                         tool="charge_card",
                         arguments={"customer_id": "cu_1", "amount_cents": 5,
                                    "sleep": sleep}).key,
    ]


def load_module(path: Path, name: str) -> Any:
    """The Python file at ``path`` (an example) as a module, to run its code in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AGENT_SCRIPT = """
import json, sys
from dex_tasks import DexClient
with DexClient.from_env() as client:
    records = [client.call_tool(session_id=sys.argv[1], turn_id="t1", tool_call_id=f"c{i}",
                                tool=tool, arguments=args)
               for i, (tool, args) in enumerate(json.loads(sys.argv[2]))]
    assert not any(m.startswith(("workers", "tests")) for m in sys.modules), "tool code imported"
    print(json.dumps([r.model_dump(mode="json") for r in records]))
"""


def agent_calls(env: dict[str, str], session: str, calls: list[tuple[str, dict[str, Any]]],
                timeout: float = 120) -> list[dict[str, Any]]:
    """Make ``calls`` (tool, arguments) from an agent process that imports no tool code (it
    asserts so): the records, as JSON."""
    out = subprocess.run([sys.executable, "-c", AGENT_SCRIPT, session, json.dumps(calls)],
                         env=env, capture_output=True, text=True, timeout=timeout, check=True)
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


def count_reads(client: Any, patch: Any) -> list[str]:
    """The keys of the calls ``client`` (a ``DexClient``) reads the record of from the store
    from now on, as its waits do on each wake-up: its read, wrapped with ``patch`` (pytest's
    ``monkeypatch``), which puts it back after the test."""
    reads: list[str] = []
    read = client._stored_call

    def counted(key: str) -> Any:
        reads.append(key)
        return read(key)

    patch.setattr(client, "_stored_call", counted)
    return reads


def wait_in_thread(client: Any, key: str,
                   timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``client.wait(key, timeout=timeout)`` in a thread of its own; the thread, and
    what it leaves once joined: ``record`` (or the ``error`` it raised) and ``took``, the
    seconds it waited."""
    out: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            out["record"] = client.wait(key, timeout=timeout)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            out["error"] = err
        out["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out
