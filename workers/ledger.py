"""An append-only, fsynced ledger: one JSON line per tool execution.

Tests and the chaos harness read it to count how often each idempotency key really ran. A line
is written and fsynced *before* the tool sleeps or returns, so a SIGKILL cannot hide an
execution that happened.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

ENV = "DEX_EXAMPLE_LEDGER"


def record(tool: str, key: str, attempt: int, **extra: Any) -> None:
    """Append one execution line to the ledger named by ``$DEX_EXAMPLE_LEDGER`` (if set)."""
    path = os.environ.get(ENV)
    if not path:
        return
    append(path, {"tool": tool, "key": key, "attempt": attempt, "pid": os.getpid(),
                  "at": time.time(), **extra})


def append(path: str | Path, entry: dict[str, Any]) -> None:
    """Append one JSON line to ``path`` and fsync it (what a SIGKILL cannot take back)."""
    line = json.dumps(entry) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every line of a ledger."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def executions(path: str | Path) -> Counter[str]:
    """How many times each idempotency key was executed."""
    return Counter(entry["key"] for entry in read(path))
