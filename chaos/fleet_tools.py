"""The fleet's I/O tools (``python -m chaos.fleet``): calls that wait on a service, as most
agent tools do, so that worker processes on the threads pool hold many at once.

The write records its execution in the fsynced ledger (``workers.ledger``) before it acts, so
a duplicate anywhere in the fleet is counted; the read may run again by design and records
nothing (an fsync per read would be the benchmark's own bottleneck).
"""

from __future__ import annotations

import time

from dex_tasks import ToolContext, tool
from workers import ledger


@tool(effect="read")
def fleet_lookup(ctx: ToolContext, item: str, sleep: float = 0.05) -> dict[str, object]:
    """A read that waits ``sleep`` seconds on its service."""
    time.sleep(sleep)
    return {"item": item, "attempt": ctx.attempt}


@tool(effect="non_idempotent_write", requires_approval=False)
def fleet_charge(ctx: ToolContext, item: str, sleep: float = 0.05) -> dict[str, object]:
    """A single-attempt write that waits ``sleep`` seconds on its service."""
    ledger.record("fleet_charge", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    return {"item": item, "charged": True}
