"""A small MCP server for the MCP adapter's tests: an order desk whose tools write every
execution to the ledger, with the idempotency key the request's ``_meta`` carried.

    python -m tests.mcp_server                # stdio
    python -m tests.mcp_server --http PORT    # streamable HTTP on 127.0.0.1:PORT/mcp
    ... --legacy                              # only the 2025 protocol (HTTP sessions)

Each start writes a ``mcp:server_start`` line (its PID and its parent's), so a test can count
how many sessions a worker process opened: a stdio session is one server process.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import METHOD_NOT_FOUND, ToolAnnotations

from workers import ledger

KEY_META = "dex/idempotency_key"

LEGACY = False


async def _legacy_only(ctx: Any, call_next: Any) -> Any:
    # With --legacy the server refuses the 2026 handshake, so clients fall back to
    # `initialize` and, over HTTP, get a session id the server forgets when it restarts.
    if LEGACY and ctx.method == "server/discover":
        raise MCPError(code=METHOD_NOT_FOUND, message="Method not found")
    return await call_next(ctx)


app = MCPServer("dex-test-orders", log_level="WARNING", middleware=[_legacy_only])


def _record(tool: str, ctx: Context, **extra: Any) -> str:
    meta = ctx.request_context.meta or {}
    key = str(meta.get(KEY_META, "-"))
    # Over HTTP: the header the tools module sends with every request (None on stdio).
    header = (ctx.headers or {}).get("x-shop-token")
    ledger.record(f"mcp:{tool}", key, 0, shop_token=header, **extra)
    return key


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup_order(order_id: str, ctx: Context) -> dict[str, Any]:
    """Look up an order by id."""
    _record("lookup_order", ctx)
    return {"order_id": order_id, "status": "shipped", "server_pid": os.getpid()}


@app.tool(annotations=ToolAnnotations(readOnlyHint=False, idempotentHint=True))
def set_address(order_id: str, address: str, ctx: Context) -> dict[str, Any]:
    """Set the delivery address of an order (the same address twice changes nothing)."""
    _record("set_address", ctx)
    return {"order_id": order_id, "address": address}


@app.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
def refund(order_id: str, amount_cents: int, ctx: Context) -> dict[str, Any]:
    """Refund part of an order."""
    key = _record("refund", ctx)
    return {"order_id": order_id, "refunded_cents": amount_cents, "key": key}


# The annotation says read-only; the worker's tools module knows better (explicit policy).
@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def archive_order(order_id: str, ctx: Context) -> dict[str, Any]:
    """Archive an order."""
    _record("archive_order", ctx)
    return {"archived": order_id}


@app.tool()
def add_note(order_id: str, text: str, ctx: Context) -> str:
    """Add a note to an order (no annotations: unclassified)."""
    _record("add_note", ctx)
    return f"noted on {order_id}: {text}"


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def wait_for(seconds: float, ctx: Context) -> dict[str, Any]:
    """Answer after ``seconds`` (a read that takes its time)."""
    _record("wait_for", ctx)
    time.sleep(seconds)
    return {"waited": seconds}


@app.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True))
def ship_order(order_id: str, seconds: float, ctx: Context) -> dict[str, Any]:
    """Ship an order; the carrier takes ``seconds`` to confirm."""
    _record("ship_order", ctx)
    time.sleep(seconds)
    return {"shipped": order_id}


@app.tool(annotations=ToolAnnotations(readOnlyHint=True))
def check_coupon(code: str, ctx: Context) -> dict[str, Any]:
    """Check a coupon code."""
    _record("check_coupon", ctx)
    raise ToolError(f"coupon {code} expired yesterday")


def main() -> None:
    global LEGACY
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None, metavar="PORT")
    parser.add_argument("--legacy", action="store_true", help="speak only the 2025 protocol")
    args = parser.parse_args()
    LEGACY = args.legacy
    ledger.record("mcp:server_start", "-", 0, ppid=os.getppid())
    if args.http is None:
        app.run()
    else:
        app.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
