"""An example MCP server: an order desk with four tools, served by ``examples/mcp_tools.py``.

Its annotations tell dex-tasks what each tool does: ``lookup_order`` only reads,
``update_address`` may be repeated safely, ``refund_payment`` is destructive (so a person
approves each call), and ``add_note`` says nothing (``examples/mcp_tools.py`` gives it a policy).

``refund_payment`` shows what a server can do with the idempotency key that dex-tasks sends in
each request's ``_meta`` (``"dex/idempotency_key"``): it answers a repeated key with the first
answer instead of refunding twice. This one keeps the keys in memory; a real service keeps them
with the refunds, in its database.

Run it on its own with ``python examples/mcp_order_server.py`` (stdio) or
``python examples/mcp_order_server.py --http 8765`` (streamable HTTP on 127.0.0.1:8765/mcp).
"""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

app = MCPServer("order-desk", log_level="WARNING")

ORDERS: dict[str, dict[str, Any]] = {
    "1001": {"order_id": "1001", "status": "shipped", "total_cents": 4200,
             "charge_id": "ch_1001", "address": "1 Main St"},
    "1002": {"order_id": "1002", "status": "processing", "total_cents": 1800,
             "charge_id": "ch_1002", "address": "9 Elm Rd"},
}
_refunds: dict[str, dict[str, Any]] = {}


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look up an order by id: its status, total and charge."""
    order = ORDERS.get(order_id)
    if order is None:
        return {"order_id": order_id, "status": "unknown"}
    return dict(order)


@app.tool(annotations=ToolAnnotations(readOnlyHint=False, idempotentHint=True))
def update_address(order_id: str, address: str) -> dict[str, Any]:
    """Set an order's delivery address (setting the same address twice changes nothing)."""
    ORDERS.setdefault(order_id, {"order_id": order_id, "status": "unknown"})["address"] = address
    return {"order_id": order_id, "address": address}


@app.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
def refund_payment(charge_id: str, amount_cents: int, ctx: Context) -> dict[str, Any]:
    """Refund part of a charge."""
    key = (ctx.request_context.meta or {}).get("dex/idempotency_key")
    if isinstance(key, str) and key in _refunds:
        return {**_refunds[key], "duplicate": True}
    refund = {"charge_id": charge_id, "refunded_cents": amount_cents, "idempotency_key": key,
              "duplicate": False}
    if isinstance(key, str):
        _refunds[key] = refund
    return refund


@app.tool()
def add_note(order_id: str, text: str) -> str:
    """Add a note to an order's history."""
    return f"note added to order {order_id}: {text}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An example MCP server (an order desk).")
    parser.add_argument("--http", type=int, metavar="PORT",
                        help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
    args = parser.parse_args()
    if args.http:
        app.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        app.run()
