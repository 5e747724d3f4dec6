"""Tools for the chaos harness and the lease tests: a randomly flaky read, GIL and CPU hogs.

Every tool records its execution in the fsynced ledger (``workers.ledger``) first, so a kill
cannot hide an execution that happened.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time

from dex_tasks import ToolContext, TransientToolError, tool
from workers import ledger

# Catastrophic backtracking: matching "a" * n + "!" takes about 2**n steps, all inside the C
# regex engine, which never releases the GIL. Nothing else in the process runs meanwhile.
_BACKTRACK = re.compile(r"(a+)+$")


@tool(effect="read", max_attempts=4)
def flaky_read(ctx: ToolContext, order_id: str, fail_rate: float = 0.3,
               sleep: float = 0.0) -> dict[str, object]:
    """A read whose service fails transiently at random (``fail_rate`` of the attempts)."""
    ledger.record("flaky_read", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    if random.random() < fail_rate:
        raise TransientToolError(f"order service busy (attempt {ctx.attempt})")
    return {"order_id": order_id, "attempt": ctx.attempt}


@tool(effect="read")
def stall_first_attempt(ctx: ToolContext, order_id: str, sleep: float) -> dict[str, object]:
    """A read whose first attempt hangs for ``sleep`` seconds; later attempts answer at once."""
    ledger.record("stall_first_attempt", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt == 1:
        time.sleep(sleep)
    return {"order_id": order_id, "attempt": ctx.attempt}


def _backtrack_seconds(n: int) -> float:
    started = time.perf_counter()
    _BACKTRACK.match("a" * n + "!")
    return time.perf_counter() - started


@tool(effect="read")
def gil_hog(ctx: ToolContext, seconds: float) -> dict[str, object]:
    """Hold the GIL without a break for at least ``seconds`` (one long C-level regex match).

    Returns ``stall``: the longest time a ticker thread in this process could not run, which
    shows the GIL really was held that long.
    """
    ledger.record("gil_hog", ctx.idempotency_key, ctx.attempt)
    base = 16
    # The fastest of a few runs: if the machine gets less busy later, the long match still
    # lasts at least ``seconds``. Each extra character doubles the work (a little more), so
    # one match of this size takes between one and about two times ``seconds`` at that speed.
    unit = max(min(_backtrack_seconds(base) for _ in range(5)), 1e-4)
    n = base + max(0, math.ceil(math.log2(seconds / unit)))
    last = time.monotonic()
    stall = 0.0
    stop = threading.Event()

    def ticker() -> None:
        nonlocal last, stall
        while not stop.wait(0.01):
            now = time.monotonic()
            stall = max(stall, now - last)
            last = now

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    time.sleep(0.05)
    started = time.monotonic()
    _BACKTRACK.match("a" * n + "!")
    held = time.monotonic() - started
    stop.set()
    thread.join()
    return {"n": n, "held": round(held, 3), "stall": round(stall, 3)}


@tool(effect="read")
def cpu_work(ctx: ToolContext, cpu_seconds: float) -> dict[str, object]:
    """Burn ``cpu_seconds`` of this process's CPU time in Python; on a loaded machine the wall
    time is several times longer."""
    ledger.record("cpu_work", ctx.idempotency_key, ctx.attempt)
    started = time.monotonic()
    spent = time.process_time()
    x = 0
    while time.process_time() - spent < cpu_seconds:
        for i in range(10_000):
            x ^= i
    return {"wall": round(time.monotonic() - started, 3), "cpu": cpu_seconds}


@tool(effect="read", max_attempts=3)
def slow_retry_read(ctx: ToolContext, order_id: str, retry_after: float = 20.0
                    ) -> dict[str, object]:
    """A read whose first attempt asks to be retried ``retry_after`` seconds later (a worker
    holds that retry's message, waiting out its countdown)."""
    ledger.record("slow_retry_read", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt == 1:
        raise TransientToolError("the order service asks to come back later",
                                 retry_after=retry_after)
    return {"order_id": order_id, "attempt": ctx.attempt}


@tool(effect="read", max_attempts=2, time_limit=2.0)
def overrunning_read(ctx: ToolContext, order_id: str, first: float = 3.0,
                     later: float = 1.5) -> dict[str, object]:
    """A read with a 2 s limit whose first attempt takes ``first`` seconds and later ones
    ``later``: on the threads pool, the abandoned first attempt returns while the second runs."""
    ledger.record("overrunning_read", ctx.idempotency_key, ctx.attempt, phase="start")
    time.sleep(first if ctx.attempt == 1 else later)
    ledger.record("overrunning_read", ctx.idempotency_key, ctx.attempt, phase="end")
    return {"order_id": order_id, "attempt": ctx.attempt}
