"""Tools for the approval tests: a rule that cannot be evaluated on some arguments."""

from __future__ import annotations

from typing import Literal

from dex_tasks import ToolContext, tool
from dex_tasks.rules import any_of, when
from workers import ledger


@tool(effect="non_idempotent_write", requires_approval=when("note", ">", 5))
def annotate(ctx: ToolContext, note: str | int) -> dict[str, object]:
    """Write a note; a rule compares it with a number, which fails for a text note."""
    ledger.record("annotate", ctx.idempotency_key, ctx.attempt)
    return {"note": note}


@tool(effect="non_idempotent_write", requires_approval=when("force", "==", True))
def deploy(ctx: ToolContext, service: str, force: bool = False) -> dict[str, object]:
    """Deploy a service; a forced deploy needs a person (issue 28 item 1's first example)."""
    ledger.record("deploy", ctx.idempotency_key, ctx.attempt)
    return {"service": service, "force": force}


@tool(effect="non_idempotent_write", requires_approval=when("amount_cents", ">", 10_000))
def default_refund(ctx: ToolContext, charge_id: str, amount_cents: int = 50_000
                   ) -> dict[str, object]:
    """A refund whose amount defaults to 50,000 (issue 28 item 1's second example)."""
    ledger.record("default_refund", ctx.idempotency_key, ctx.attempt)
    return {"charge_id": charge_id, "amount_cents": amount_cents}


PROBE_RULE = any_of(when("amount", ">", 10_000), when("force", "==", True),
                    when("tier", "==", "new"), when("ratio", ">=", 2))


@tool(effect="non_idempotent_write", requires_approval=PROBE_RULE)
def probe(ctx: ToolContext, amount: int = 50_000, force: bool = False,
          tier: Literal["new", "old"] = "old", ratio: float = 1.0,
          note: str | None = None, tags: list[int] | None = None) -> dict[str, object]:
    """Returns the arguments it ran with: the property test's executed arguments."""
    ledger.record("probe", ctx.idempotency_key, ctx.attempt)
    return {"amount": amount, "force": force, "tier": tier, "ratio": ratio, "note": note,
            "tags": tags}
