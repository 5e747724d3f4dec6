"""Celery's worker options on ``dex-tasks worker``: which pass through, which change the app's
configuration, and which are refused because they would change what dex-tasks guarantees.

An operator who runs Celery workers reaches for ``-n``, ``--max-tasks-per-child``,
``--autoscale``, ``--prefetch-multiplier``, ``-O fair`` and the ``--without-*`` switches;
``dex-tasks worker`` accepts them, and hands any other option it does not know to Celery's own
``worker`` command, which checks it. Each option was weighed against the guarantees:

* ``-n/--hostname``: the node name shows in Flower and ``celery inspect``; a running call's
  owner is ``<node>:<pid>``, so two processes never share an owner. Two live workers with one
  node name would overwrite each other's announcement (``routing.Presence``), and the sweep
  that restores a vanished worker's messages would then hand a live worker's messages to
  others: a second worker with the name of a live one is refused at start-up.
* ``--prefetch-multiplier N``: by default a worker takes a message only when a slot is free
  (``worker_disable_prefetch``). N > 1 lets it reserve N per slot. A message reserved by a
  worker that dies is not lost and does not run twice: it sits in kombu's unacked hash, the
  sweep ``restore_orphaned_messages`` hands it back once the worker's announcement lapses,
  and the claims turn away whatever copy arrives late. What prefetch costs is latency: a
  reserved message waits behind its worker's busy slots while other workers idle.
* ``--autoscale MAX,MIN`` (prefork only): billiard shrinks the pool by stopping idle children
  only, so no running call loses its process; a call whose child is lost anyway is handled
  like any lost child (``main_process.DexRequest``). The threads pool cannot grow or shrink.
* ``--max-tasks-per-child``, ``--max-memory-per-child``: a child is replaced after its call
  ends, which is the same as a child that exits between calls.
* ``-O fair``, ``--without-heartbeat``, ``--heartbeat-interval``, ``-S``, ``-I``: pass
  through. Gossip and mingle are always off (every worker would otherwise talk to every
  other over the broker, which a fleet pays for in Redis commands); ``--without-gossip`` and
  ``--without-mingle`` are accepted and change nothing.

Refused, each with its reason (:data:`REFUSED`): options that would route messages past the
tools' queues, run a second beat, purge queued calls' messages, detach, change how children
start, or put a worker-wide time limit over the tools' own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from dex_tasks.errors import ConfigurationError

# Option spellings that would change what dex-tasks guarantees, and why each is refused.
REFUSED: dict[str, str] = {
    "-Q": "a worker consumes the queues of the tools it serves; choose them with --serve",
    "--queues": "a worker consumes the queues of the tools it serves; choose them with --serve",
    "-X": "a worker consumes the queues of the tools it serves; choose them with --serve",
    "--exclude-queues": "a worker consumes the queues of the tools it serves; choose them "
                        "with --serve",
    "-B": "the sweeps run in `dex-tasks beat`, not in a worker",
    "--beat": "the sweeps run in `dex-tasks beat`, not in a worker",
    "--purge": "purging drops the messages of queued calls (they would wait for the "
               "republisher); end calls through dex-tasks instead",
    "--discard": "purging drops the messages of queued calls (they would wait for the "
                 "republisher); end calls through dex-tasks instead",
    "-D": "run the worker under a supervisor (systemd, compose) instead of detaching",
    "--detach": "run the worker under a supervisor (systemd, compose) instead of detaching",
    "--pool-start-method": "children are forked after the tool modules are imported; a "
                           "spawned child would have no tools",
    "--time-limit": "time limits are per tool (@tool(time_limit=...)), recorded in each "
                    "call's policy",
    "--soft-time-limit": "time limits are per tool (@tool(time_limit=...)), recorded in each "
                         "call's policy",
    "--disable-prefetch": "it is the default; --prefetch-multiplier N turns it off",
}


class WorkerOptionError(ConfigurationError):
    """A ``dex-tasks worker`` option that is refused or malformed (the message says why)."""


@dataclass(frozen=True)
class WorkerOptions:
    """The Celery worker options of one ``dex-tasks worker``, checked."""

    pool: str
    concurrency: int
    hostname: str | None = None
    max_tasks_per_child: int | None = None
    max_memory_per_child: int | None = None
    autoscale: str | None = None
    prefetch_multiplier: int | None = None
    optimization: str | None = None
    without_heartbeat: bool = False
    passthrough: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.autoscale is not None:
            if self.pool != "prefork":
                raise WorkerOptionError(
                    f"--autoscale needs the prefork pool: the {self.pool} pool cannot grow or "
                    "shrink (set -c to the threads you want)")
            parse_autoscale(self.autoscale)
        if self.prefetch_multiplier is not None and self.prefetch_multiplier < 1:
            raise WorkerOptionError(
                f"--prefetch-multiplier must be 1 or more, got {self.prefetch_multiplier}")
        check_passthrough(self.passthrough)

    @property
    def slots(self) -> int:
        """The most calls this worker runs at once (what it announces)."""
        if self.autoscale is not None:
            return parse_autoscale(self.autoscale)[0]
        return self.concurrency

    @property
    def prefetches(self) -> bool:
        """True when the worker reserves messages ahead of its free slots."""
        return self.prefetch_multiplier is not None and self.prefetch_multiplier > 1

    def node_name(self) -> str:
        """The node name Celery will use, expanded (``%h``, ``%n``, ``%d``) as Celery does."""
        from celery.utils.nodenames import default_nodename, host_format

        return str(host_format(default_nodename(self.hostname or "")))

    def celery_args(self, loglevel: str, *, quiet: bool) -> list[str]:
        """The argument list for ``celery.worker_main``."""
        args = [
            *(["--quiet"] if quiet else []),
            "worker",
            "-P", self.pool,
            "-n", self.hostname or default_hostname(),
            "--loglevel", loglevel,
            "--without-gossip", "--without-mingle",
        ]
        if self.autoscale is not None:
            args += ["--autoscale", self.autoscale]
        else:
            args += ["-c", str(self.concurrency)]
        for option, value in (("--max-tasks-per-child", self.max_tasks_per_child),
                              ("--max-memory-per-child", self.max_memory_per_child),
                              ("--prefetch-multiplier", self.prefetch_multiplier),
                              ("-O", self.optimization)):
            if value is not None:
                args += [option, str(value)]
        if self.without_heartbeat:
            args.append("--without-heartbeat")
        return [*args, *self.passthrough]


def default_hostname() -> str:
    """A node name of this process's own (``dex-<pid>@%h``), unless ``-n`` names one."""
    return f"dex-{os.getpid()}@%h"


def parse_autoscale(value: str) -> tuple[int, int]:
    """``MAX,MIN`` (or ``MAX``) as Celery reads it; refused unless 1 <= MIN <= MAX."""
    parts = [p.strip() for p in value.split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 2:
        raise WorkerOptionError(f"--autoscale takes MAX,MIN (e.g. 10,2), got {value!r}")
    high = numbers[0]
    low = numbers[1] if len(numbers) == 2 else 0
    if high < 1 or low < 0 or low > high:
        raise WorkerOptionError(
            f"--autoscale takes MAX,MIN with MAX >= 1 and 0 <= MIN <= MAX, got {value!r}")
    return high, low


def check_passthrough(args: Sequence[str]) -> None:
    """Refuse, with its reason, any option in ``args`` that :data:`REFUSED` lists."""
    for arg in args:
        if not arg.startswith("-") or arg == "-":
            continue
        name = arg.split("=", 1)[0]
        if not name.startswith("--") and len(name) > 2:
            name = name[:2]  # -Qqueue, -B...: the short option is its first two characters
        reason = REFUSED.get(name)
        if reason is not None:
            raise WorkerOptionError(f"dex-tasks worker does not take {name}: {reason}")


def hostname_taken(record: dict[str, object] | None, *, alive: bool | None = None) -> str | None:
    """Why a worker may not start under a node name a live announcement ``record`` holds.

    None when the name is free: no announcement, or one left by this very host and process
    id (a container restarted with its old name), or one whose process on this host is gone.
    ``alive`` says whether the recorded process lives on this host (None: look it up).
    """
    if record is None:
        return None
    host, pid = record.get("host"), record.get("pid")
    if host == socket.gethostname():
        if pid == os.getpid():
            return None
        if alive is None:
            from dex_tasks.ops.procutil import pid_alive

            alive = isinstance(pid, int) and pid_alive(pid)
        if not alive:
            return None
    return (f"the node name {record.get('node')!r} is in use by a live worker (host {host}, "
            f"pid {pid}); give this one another -n, or wait until that announcement lapses")
