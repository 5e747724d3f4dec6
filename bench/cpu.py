"""CPU time per process group from ``/proc/<pid>/stat`` deltas (issue 29, deliverable 5).

A :class:`CpuMeter` is given named groups of processes (the producer, a worker's main process,
its children, Redis, the database server and its backends), each as a function that lists the
group's PIDs at the time of asking (children and PostgreSQL backends come and go). ``start``
reads every PID's user + system time; ``stop`` reads them again and returns each group's CPU
seconds in between. A PID that appeared in between counts from zero (a backend that connected
during the run); one that exited in between is lost (it is not in ``/proc`` any more), which
the benchmarks avoid by keeping their processes alive through a measured run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dex_tasks.ops.procutil import children_of

TICKS = os.sysconf("SC_CLK_TCK")

PidsOf = Callable[[], Iterable[int]]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = raw[raw.rindex(")") + 2:].split()
    # utime and stime are fields 14 and 15 of the line, 12th and 13th after the name.
    return (int(fields[11]) + int(fields[12])) / TICKS


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children_of(current)
    return out


def fixed(*pids: int) -> PidsOf:
    """A group of known PIDs."""
    return lambda: pids


def children(pid: int) -> PidsOf:
    """The direct children of ``pid`` (a prefork worker's pool), as they are when asked."""
    return lambda: children_of(pid)


def tree(pid: int) -> PidsOf:
    """``pid`` and all its descendants (a PostgreSQL server and its backends)."""
    return lambda: process_tree(pid)


@dataclass
class CpuMeter:
    """CPU seconds per named group of processes between :meth:`start` and :meth:`stop`."""

    groups: dict[str, PidsOf]
    _before: dict[str, dict[int, float]] = field(default_factory=dict)

    def _read(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for name, pids_of in self.groups.items():
            seen: dict[int, float] = {}
            for pid in pids_of():
                value = cpu_seconds(pid)
                if value is not None:
                    seen[pid] = value
            out[name] = seen
        return out

    def start(self) -> CpuMeter:
        self._before = self._read()
        return self

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {name: sum(value - self._before.get(name, {}).get(pid, 0.0)
                          for pid, value in after[name].items())
                for name in self.groups}


def per_call_us(cpu: dict[str, float], calls: int) -> dict[str, float]:
    """CPU microseconds per call of each group, and their ``total``."""
    out = {name: round(seconds / calls * 1e6, 1) for name, seconds in cpu.items()}
    out["total"] = round(sum(cpu.values()) / calls * 1e6, 1)
    return out
