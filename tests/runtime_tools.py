"""Tools for the catalog tests: tools defined at run time from a JSON schema (as a proxy such
as an MCP adapter defines them), and tools that raise ``OutcomeUnknownError``.

A worker imports this module with ``--tools tests.runtime_tools``.
"""

from __future__ import annotations

from typing import Any

from dex_tasks import OutcomeUnknownError, ToolContext, define_tool, tool
from workers import ledger

SKU_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "minLength": 3},
        "qty": {"type": "integer", "minimum": 1},
        # Not a Python identifier: a schema tool takes its arguments as one dict.
        "class": {"type": "string", "enum": ["retail", "wholesale"]},
    },
    "required": ["sku", "qty"],
    "additionalProperties": False,
}


def _price(ctx: ToolContext, arguments: dict[str, Any]) -> dict[str, Any]:
    ledger.record("price_sku", ctx.idempotency_key, ctx.attempt)
    unit = 250 if arguments.get("class") == "wholesale" else 400
    return {"sku": arguments["sku"], "total_cents": unit * arguments["qty"]}


price_sku = define_tool("price_sku", SKU_SCHEMA, _price, effect="read",
                        description="Price a quantity of one SKU.")


def _delete(ctx: ToolContext, arguments: dict[str, Any]) -> dict[str, Any]:
    ledger.record("delete_listing", ctx.idempotency_key, ctx.attempt)
    return {"deleted": arguments["listing_id"]}


# No policy: the MCP annotations decide (destructive, so a non-idempotent write).
delete_listing = define_tool(
    "delete_listing",
    {"type": "object", "properties": {"listing_id": {"type": "string"}},
     "required": ["listing_id"]},
    _delete,
    hints={"destructiveHint": True, "readOnlyHint": False},
)


@tool(effect="read", max_attempts=3)
def unsure_read(ctx: ToolContext, query: str) -> dict[str, Any]:
    """A read whose backend timed out after accepting the request."""
    ledger.record("unsure_read", ctx.idempotency_key, ctx.attempt)
    raise OutcomeUnknownError(f"the search backend timed out on {query!r}")


@tool(effect="non_idempotent_write", requires_approval=False)
def unsure_charge(ctx: ToolContext, amount_cents: int) -> dict[str, Any]:
    """A charge whose payment provider dropped the connection after the request was sent."""
    ledger.record("unsure_charge", ctx.idempotency_key, ctx.attempt)
    raise OutcomeUnknownError("the connection dropped after the charge request was sent")
