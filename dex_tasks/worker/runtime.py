"""A worker process's runtime: its connections (store, Redis, the Celery app), created lazily
after the fork, and how a running attempt names the process and thread that own it."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import redis
from celery import Celery

from dex_tasks.broker import announce, webhooks
from dex_tasks.broker.redis_clients import connector, redis_client
from dex_tasks.broker.runs import Runs
from dex_tasks.settings import DexSettings
from dex_tasks.store import INHERITED, NetworkBounds, Store
from dex_tasks.worker.group_commit import EndCommits


@dataclass
class Runtime:
    """The per-process connections a worker uses. Created lazily, after the fork."""

    settings: DexSettings
    store: Store
    redis: redis.Redis
    app: Celery
    # The running attempts of retrying calls (leases and attempt counts in Redis).
    runs: Runs = field(init=False)
    # The group commit of this process's endings.
    ends: EndCommits = field(init=False)

    def __post_init__(self) -> None:
        self.runs = Runs(self.redis)
        self.ends = EndCommits(self.store, self.settings.end_commit_hold_seconds)
        # Every runtime ends calls (worker children, the main process, sweeps): announce each
        # one on Redis after its commit, which wakes its waiters and counts it for /metrics.
        # The ended record travels with the announcement, signed with the store's key, and
        # its waiters need no read of the store.
        announce.install(self.store, self.settings.redis_url, connector(self.settings),
                         claim_ended_ttl=self.settings.claim_ended_ttl_seconds)
        # Approval events it writes (the deadline sweeps) are sent as webhooks after commit.
        webhooks.install(self.store, self.settings, lambda: self.app)


_runtime: Runtime | None = None
# The threads pool (and beat's sweep threads) may ask for the runtime from many threads at once.
_runtime_lock = threading.Lock()


def runtime(app: Celery) -> Runtime:
    """This process's runtime, created on first use."""
    global _runtime
    current = _runtime
    if current is not None and current.app is app:
        return current
    with _runtime_lock:
        if _runtime is None or _runtime.app is not app:
            settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
            _runtime = Runtime(
                settings=settings,
                store=Store(settings.database_url,
                            retry_seconds=settings.store_retry_seconds,
                            network=NetworkBounds.from_settings(settings)),
                redis=redis_client(settings, socket_timeout=10),
                app=app,
            )
        return _runtime


def reset_runtime() -> None:
    """Start over with connections of this process's own (in a forked child).

    The inherited runtime is kept referenced, not closed: closing its connections here would
    close the parent's (see ``store.INHERITED``).
    """
    global _runtime
    if _runtime is not None:
        INHERITED.append(_runtime)
    _runtime = None


def owner_id(hostname: str | None, pid: int | None) -> str:
    """How a running call names the process that runs it: ``<worker node>:<child pid>``."""
    return f"{hostname}:{pid}"


def current_owner(hostname: str | None) -> str:
    """The owner id of the attempt this thread runs.

    ``<node>:<pid>`` in a process that runs one call at a time (a prefork child), and
    ``<node>:<pid>:<thread id>`` in a pool thread: the threads of one process must never share
    an owner id, or a thread abandoned at its time limit could still finish the attempt that
    another thread of the same worker runs now.
    """
    owner = owner_id(hostname, os.getpid())
    if threading.current_thread() is threading.main_thread():
        return owner
    return f"{owner}:{threading.get_native_id()}"
