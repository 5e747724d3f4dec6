"""Tools for the approval tests: a rule that cannot be evaluated on some arguments."""

from __future__ import annotations

from dex_tasks import ToolContext, tool
from dex_tasks.rules import when
from workers import ledger


@tool(effect="non_idempotent_write", requires_approval=when("note", ">", 5))
def annotate(ctx: ToolContext, note: str | int) -> dict[str, object]:
    """Write a note; a rule compares it with a number, which fails for a text note."""
    ledger.record("annotate", ctx.idempotency_key, ctx.attempt)
    return {"note": note}
