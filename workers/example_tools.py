"""Example tools: an order lookup (read), an address update (idempotent write), a card charge
and an order cancellation (non-idempotent writes; the cancellation, like a refund, waits for a
person's approval), and a few helpers for tests and the demo.

Each records its execution in the ledger (``workers.ledger``) before it does anything slow, and
takes an optional ``sleep`` so tests can kill a worker while the tool runs.

The ledger also stands in for the services' own records: ``charge_card``'s and
``cancel_order``'s reconcilers ask it whether the operation with a given idempotency key reached
the payment provider or the order system.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded

from dex_tasks import ToolContext, TransientToolError, tool
from dex_tasks.rules import when
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


@charge_card.reconciler
def check_charge(idempotency_key: str, arguments: dict[str, Any]) -> str | None:
    """Ask the payment provider (here: the ledger) whether the charge with this key happened.

    Returns None when there is no provider to ask, so the call is checked again later.
    """
    path = os.environ.get(ledger.ENV)
    if not path:
        return None
    amount = arguments.get("amount_cents")
    customer = arguments.get("customer_id")
    if ledger.executions(path)[idempotency_key]:
        return (f"Note from the payment system: the charge of {amount} cents to customer "
                f"{customer} went through. Do not charge again.")
    return (f"Note from the payment system: the charge of {amount} cents to customer "
            f"{customer} did not happen. It is safe to charge again.")


@tool(effect="non_idempotent_write")
def refund_payment(ctx: ToolContext, charge_id: str, amount_cents: int) -> dict[str, object]:
    """Refund a payment. Waits for a person's approval (the default for this effect class)."""
    ledger.record("refund_payment", ctx.idempotency_key, ctx.attempt)
    return {"charge_id": charge_id, "refunded_cents": amount_cents}


@tool(effect="non_idempotent_write", requires_approval=when("amount_cents", ">", 10_000))
def issue_refund(ctx: ToolContext, charge_id: str, amount_cents: int) -> dict[str, object]:
    """Refund a payment; refunds over $100 (10,000 cents) wait for a person (a rule on the
    arguments, evaluated where the call is made)."""
    ledger.record("issue_refund", ctx.idempotency_key, ctx.attempt)
    return {"charge_id": charge_id, "refunded_cents": amount_cents}


@tool(effect="non_idempotent_write", approvals=2, approver_permission="payments.approve")
def wire_transfer(ctx: ToolContext, account: str, amount_cents: int) -> dict[str, object]:
    """Send a wire transfer: two distinct approvers holding ``payments.approve`` must agree."""
    ledger.record("wire_transfer", ctx.idempotency_key, ctx.attempt)
    return {"account": account, "sent_cents": amount_cents}


@tool(effect="non_idempotent_write")
def cancel_order(ctx: ToolContext, order_id: str, reason: str = "",
                 sleep: float = 0.0) -> dict[str, object]:
    """Cancel an order. A non-idempotent write with no ``requires_approval`` set, so by the
    default of its effect class every call waits for a person's approval before it runs."""
    ledger.record("cancel_order", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    if order_id not in ORDERS:
        raise LookupError(f"no order {order_id}")
    return {"order_id": order_id, "status": "cancelled", "reason": reason,
            "request_id": ctx.idempotency_key}


@cancel_order.reconciler
def check_cancellation(idempotency_key: str, arguments: dict[str, Any]) -> str | None:
    """Ask the order system (here: the ledger) whether the cancellation with this key ran."""
    path = os.environ.get(ledger.ENV)
    if not path:
        return None
    order = arguments.get("order_id")
    if ledger.executions(path)[idempotency_key]:
        return (f"Note from the order system: order {order} is cancelled. Do not cancel it "
                "again.")
    return (f"Note from the order system: order {order} was not cancelled. It is safe to ask "
            "for the cancellation again.")


@tool(effect="read")
def broken_report(ctx: ToolContext, report: str) -> dict[str, object]:
    """A read whose service rejects the request: a non-transient error, not retried."""
    ledger.record("broken_report", ctx.idempotency_key, ctx.attempt)
    raise ValueError(f"report {report!r} does not exist")


# -- tools with time limits (tests of hard and soft limits) -------------------------------------


@tool(effect="non_idempotent_write", requires_approval=False, time_limit=1.0)
def timed_charge(ctx: ToolContext, customer_id: str, amount_cents: int,
                 sleep: float = 0.0) -> dict[str, object]:
    """A charge with a 1 s time limit; ``sleep`` longer than that to hit it."""
    ledger.record("timed_charge", ctx.idempotency_key, ctx.attempt)
    time.sleep(sleep)
    return {"customer_id": customer_id, "charged_cents": amount_cents}


@tool(effect="read", max_attempts=2, time_limit=1.0)
def timed_lookup(ctx: ToolContext, order_id: str, slow_attempts: int = 1) -> dict[str, object]:
    """A read with a 1 s time limit whose first ``slow_attempts`` attempts take too long."""
    ledger.record("timed_lookup", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt <= slow_attempts:
        time.sleep(30)
    return {"order_id": order_id, "attempt": ctx.attempt}


@tool(effect="idempotent_write", max_attempts=2, time_limit=1.0)
def timed_address(ctx: ToolContext, order_id: str, address: str,
                  slow_attempts: int = 1) -> dict[str, object]:
    """An idempotent write with a 1 s time limit; the first ``slow_attempts`` attempts hang."""
    ledger.record("timed_address", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt <= slow_attempts:
        time.sleep(30)
    return {"order_id": order_id, "address": address, "attempt": ctx.attempt}


def _ignore_soft_limit(tool_name: str, ctx: ToolContext, mode: str, run_for: float) -> None:
    """Keep running past the soft limit, logging a tick every few ms; then log "after_limit".

    ``mode="catch"`` swallows ``SoftTimeLimitExceeded``; ``mode="mask"`` blocks the warning
    signal, like C code that never returns to the interpreter. Only a kill stops either.
    """
    if mode == "mask":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    elif mode != "catch":
        raise ValueError(f"mode must be 'catch' or 'mask', got {mode!r}")
    try:
        deadline = time.monotonic() + run_for
        while time.monotonic() < deadline:
            try:
                time.sleep(0.005)
                ledger.record(tool_name, ctx.idempotency_key, ctx.attempt, phase="tick")
            except SoftTimeLimitExceeded:
                ledger.record(tool_name, ctx.idempotency_key, ctx.attempt, phase="soft_limit")
        ledger.record(tool_name, ctx.idempotency_key, ctx.attempt, phase="after_limit")
    finally:
        if mode == "mask":
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


@tool(effect="non_idempotent_write", requires_approval=False, time_limit=1.0)
def stubborn_charge(ctx: ToolContext, customer_id: str, amount_cents: int,
                    mode: str = "catch", run_for: float = 3.0) -> dict[str, object]:
    """A charge that ignores its soft time limit (see ``_ignore_soft_limit``)."""
    ledger.record("stubborn_charge", ctx.idempotency_key, ctx.attempt, phase="start")
    _ignore_soft_limit("stubborn_charge", ctx, mode, run_for)
    return {"customer_id": customer_id, "charged_cents": amount_cents}


@tool(effect="read", max_attempts=2, time_limit=1.0)
def stubborn_lookup(ctx: ToolContext, order_id: str, mode: str = "catch",
                    run_for: float = 3.0) -> dict[str, object]:
    """A read whose first attempt ignores its soft time limit; the second is quick."""
    ledger.record("stubborn_lookup", ctx.idempotency_key, ctx.attempt, phase="start")
    if ctx.attempt == 1:
        _ignore_soft_limit("stubborn_lookup", ctx, mode, run_for)
    return {"order_id": order_id, "attempt": ctx.attempt}
