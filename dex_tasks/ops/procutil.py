"""Small process helpers shared by the demo, the tests, the chaos harness and the benchmarks."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition",
               interval: float = 0.02, error: type[Exception] = AssertionError) -> T:
    """Poll ``predicate`` until it returns something truthy and return that.

    Raises ``error`` naming ``what`` after ``timeout`` seconds (``AssertionError`` by default,
    so a test fails with a message rather than erroring).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children_of(pid: int) -> list[int]:
    """Direct child PIDs of ``pid`` (Linux ``/proc``)."""
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


def dex_command() -> list[str]:
    """How to run this environment's ``dex-tasks`` (the console script, else ``-m``)."""
    script = Path(sys.executable).parent / "dex-tasks"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dex_tasks.ops.cli"]


def redis_pings(client: redis.Redis) -> bool:
    """True if the Redis server answers PING."""
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
