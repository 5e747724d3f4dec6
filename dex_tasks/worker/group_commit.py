"""Group commit of ends in one worker process (DESIGN version 4, "Ends may commit together").

The threads of a ``--pool threads`` worker end calls independently, each in a durable commit of
its own. Here an ending that finds other calls running in its process may wait up to
``DEX_END_COMMIT_HOLD_SECONDS`` (a few milliseconds) for their endings, and the first of them
(the leader) commits them all in one transaction: one fsync or one server commit for many
calls. Each ending is still its own guarded transition in that transaction, so it wins or loses
exactly as alone. Claims never come through here, and nothing is announced before the commit:
the store's ``on_calls_ended`` hooks (which wake the waiters) run once the shared transaction has
committed. A prefork child runs one call at a time, so its endings are never held.

If the shared transaction fails (a lost connection, one ending the store refuses), each ending
is run again alone, with the store's own retries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from dex_tasks.store import Store

# Most endings committed in one transaction.
MAX_BATCH = 64


@dataclass
class _Ending:
    move: Callable[[Connection], bool]
    alone: Callable[[], bool]
    done: bool = False
    won: bool = False
    error: BaseException | None = None


class EndCommits:
    """The endings of one process's attempts, committed together when they come together."""

    def __init__(self, store: Store, hold: float) -> None:
        self.store = store
        self.hold = hold
        self._cond = threading.Condition()
        self._pending: list[_Ending] = []
        self._leading = False
        # Attempts of this process that have started and not yet asked to end; which thread
        # runs one (each counts once, whichever way it leaves).
        self._running = 0
        self._local = threading.local()

    def started(self) -> None:
        """This thread's attempt started (its ending may come soon)."""
        with self._cond:
            if not getattr(self._local, "running", False):
                self._local.running = True
                self._running += 1

    def _leave(self) -> None:
        # Under the lock.
        if getattr(self._local, "running", False):
            self._local.running = False
            self._running -= 1

    def left(self) -> None:
        """This thread's attempt is over, however it ended (a no-op after :meth:`commit`)."""
        with self._cond:
            self._leave()

    def commit(self, move: Callable[[Connection], bool], alone: Callable[[], bool]) -> bool:
        """End a call: ``move(conn)`` in a transaction shared with the other endings of this
        process, or ``alone()`` in one of its own when none may come (or when holding is off).
        Returns what the move returned, once its transaction has committed."""
        with self._cond:
            self._leave()
            grouped = self.hold > 0 and bool(self._running or self._pending or self._leading)
            if grouped:
                ending = _Ending(move, alone)
                self._pending.append(ending)
                while self._leading and not ending.done:
                    self._cond.wait()
                if ending.done:
                    return self._result(ending)
                self._leading = True
                deadline = time.monotonic() + self.hold
                while (len(self._pending) < MAX_BATCH and self._running > 0
                       and (left := deadline - time.monotonic()) > 0):
                    self._cond.wait(left)
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        if not grouped:
            return alone()
        try:
            self._commit(batch)
        finally:
            with self._cond:
                self._leading = False
                for item in batch:
                    item.done = True
                self._cond.notify_all()
        return self._result(ending)

    def _commit(self, batch: list[_Ending]) -> None:
        if len(batch) > 1:
            try:
                with self.store.write() as tx:
                    for item in batch:
                        item.won = item.move(tx)
                return
            except Exception:  # noqa: BLE001 - each ending is tried again alone below
                pass
        for item in batch:
            try:
                item.won = item.alone()
            except BaseException as err:  # noqa: BLE001 - handed to its own thread
                item.error = err

    @staticmethod
    def _result(ending: _Ending) -> bool:
        if ending.error is not None:
            raise ending.error
        return ending.won
