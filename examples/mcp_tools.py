"""A worker's ``--tools`` module that serves the tools of an MCP server as dex tools.

The server is ``examples/mcp_order_server.py``, run over stdio: one server process per worker
process, started on its first call and kept for every later one. Its tools become
``orders_lookup_order`` (a read, from its annotation), ``orders_update_address`` (an idempotent
write), ``orders_refund_payment`` (destructive: each call waits for a person) and
``orders_add_note`` (no annotation; the policy below makes it an idempotent write).

From the repository root, with Redis on localhost (the store defaults to a SQLite file)::

    pip install -e ".[mcp]"
    dex-tasks worker --tools examples.mcp_tools -c 2

Any agent process then calls the tools by name; it imports no tool code, the worker published
them. For example::

    python - <<'EOF'
    from dex_tasks import DexClient
    client = DexClient.from_env()
    read = client.call_tool(session_id="mcp-demo", turn_id="t1", tool_call_id="c1",
                            tool="orders_lookup_order", arguments={"order_id": "1001"})
    print("lookup:", client.wait(read.key).result)
    refund = client.call_tool(session_id="mcp-demo", turn_id="t1", tool_call_id="c2",
                              tool="orders_refund_payment",
                              arguments={"charge_id": "ch_1001", "amount_cents": 500})
    print("refund:", refund.status.value)
    client.resolve_interrupt("mcp-demo", refund.interrupt_id, True, approver="you")
    print("refund:", client.wait(refund.key).result)
    EOF

The refund waits for approval, runs once, and the server reports the idempotency key it
received. ``dex-tasks calls mcp-demo`` lists the session's calls. To serve an HTTP server
instead, start ``python examples/mcp_order_server.py --http 8765`` and pass its URL,
``"http://127.0.0.1:8765/mcp"``, to ``mcp_tools``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dex_tasks.integrations.mcp import mcp_tools

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_order_server.py"))]

tools = mcp_tools(SERVER, prefix="orders_", policies={"add_note": "idempotent_write"})
