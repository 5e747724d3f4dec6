"""Example tools: an order lookup (read), an address update (idempotent write), a card charge
(non-idempotent write), and a few helpers for tests and the demo.

Each records its execution in the ledger (``workers.ledger``) before it does anything slow, and
takes an optional ``sleep`` so tests can kill a worker while the tool runs.
"""

from __future__ import annotations

import time

from dex_tasks import ToolContext, TransientToolError, tool
from workers import ledger

ORDERS = {
    "1001": {"status": "shipped", "total_cents": 4599},
    "1002": {"status": "processing", "total_cents": 1250},
}


@tool(effect="read")
def lookup_order(ctx: ToolContext, order_id: str, sleep: float = 0.0) -> dict[str, object]:
    """Look up an order by id."""
    ledger.record("lookup_order", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    order = ORDERS.get(order_id)
    if order is None:
        raise LookupError(f"no order {order_id}")
    return {"order_id": order_id, **order}


@tool(effect="read", max_attempts=4)
def flaky_lookup(ctx: ToolContext, order_id: str, fail_times: int = 1) -> dict[str, object]:
    """A read that fails transiently on its first ``fail_times`` attempts."""
    ledger.record("flaky_lookup", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt <= fail_times:
        raise TransientToolError(f"order service busy (attempt {ctx.attempt})")
    return {"order_id": order_id, "attempt": ctx.attempt}


@tool(effect="idempotent_write")
def update_address(ctx: ToolContext, order_id: str, address: str,
                   sleep: float = 0.0) -> dict[str, object]:
    """Set an order's shipping address; the service drops repeats of the same key."""
    ledger.record("update_address", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    return {"order_id": order_id, "address": address, "request_id": ctx.idempotency_key}


@tool(effect="non_idempotent_write", requires_approval=False)
def charge_card(ctx: ToolContext, customer_id: str, amount_cents: int,
                sleep: float = 0.0) -> dict[str, object]:
    """Charge a card. Not idempotent: a second run charges twice, so it runs at most once."""
    ledger.record("charge_card", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    return {"customer_id": customer_id, "charged_cents": amount_cents,
            "charge_id": f"ch_{abs(hash(ctx.idempotency_key)) % 10**8:08d}"}


@tool(effect="non_idempotent_write")
def refund_payment(ctx: ToolContext, charge_id: str, amount_cents: int) -> dict[str, object]:
    """Refund a payment. Waits for a person's approval (the default for this effect class)."""
    ledger.record("refund_payment", ctx.idempotency_key, ctx.attempt)
    return {"charge_id": charge_id, "refunded_cents": amount_cents}


@tool(effect="read")
def broken_report(ctx: ToolContext, report: str) -> dict[str, object]:
    """A read whose service rejects the request: a non-transient error, not retried."""
    ledger.record("broken_report", ctx.idempotency_key, ctx.attempt)
    raise ValueError(f"report {report!r} does not exist")
