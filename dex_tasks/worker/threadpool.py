"""The hard time limit on the ``threads`` pool, which Celery does not enforce there.

On ``prefork`` a call past its hard limit has its child killed (``main_process.DexRequest``).
A thread cannot be killed: Celery's threads pool ignores time limits altogether. So a worker on
that pool runs a :class:`Watchdog` that, when a call's limit passes, does what the kill would
have recorded (``execution.handle_lost_attempt``): a single-attempt call ends
``outcome_unknown``, a retrying call is queued again while it has attempts left (else a read
ends ``failed`` and a write ``outcome_unknown``). The thread is abandoned: it runs on until the
tool returns, holding its slot, and whatever it then tries to record is refused, because the
call is no longer ``running`` under that thread's owner id (``execution.current_owner``).

There is no soft limit on this pool (nothing can raise ``SoftTimeLimitExceeded`` inside a
thread blocked in I/O), and a retrying call's next attempt may start while the abandoned one is
still inside the tool: retrying tools are reads and idempotent writes, which tolerate that, and
single-attempt calls are never run again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("dex_tasks.worker.threadpool")


@dataclass(order=True)
class Watched:
    """One attempt under watch: when its limit passes, and what to act on."""

    deadline: float
    seq: int
    task_id: str = field(compare=False)
    key: str = field(compare=False)
    owner: str = field(compare=False)
    limit: float = field(compare=False)
    expired: bool = field(default=False, compare=False)


class Watchdog(threading.Thread):
    """Calls ``on_expired`` for each watched attempt still running when its limit passes."""

    def __init__(self, on_expired: Callable[[Watched], None]) -> None:
        super().__init__(name="dex-time-limits", daemon=True)
        self.on_expired = on_expired
        self._cond = threading.Condition()
        self._heap: list[Watched] = []
        self._by_task: dict[str, Watched] = {}
        self._seq = itertools.count()
        self.stopped = False

    def watch(self, task_id: str, key: str, owner: str, limit: float) -> None:
        """Start the clock of one attempt (called in the thread that runs it)."""
        entry = Watched(time.monotonic() + limit, next(self._seq), task_id, key, owner, limit)
        with self._cond:
            self._by_task[task_id] = entry
            heapq.heappush(self._heap, entry)
            self._cond.notify()

    def forget(self, task_id: str) -> Watched | None:
        """Stop watching an attempt that returned; the entry (``expired`` if it was abandoned)."""
        with self._cond:
            return self._by_task.pop(task_id, None)

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            due = self._next_due()
            if due is None:
                return
            try:
                self.on_expired(due)
            except Exception:
                log.exception("could not end a call past its time limit",
                              extra={"action": "time_limit_error", "key": due.key})

    def _next_due(self) -> Watched | None:
        with self._cond:
            while not self.stopped:
                # Entries whose attempt already returned are dropped as they surface.
                while self._heap and self._by_task.get(self._heap[0].task_id) is not self._heap[0]:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0].deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry.expired = True
                return entry
            return None
