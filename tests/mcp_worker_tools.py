"""The MCP adapter's tests: a worker's ``--tools`` module wrapping ``tests/mcp_server.py``.

Over stdio by default; over streamable HTTP when ``DEX_TEST_MCP_URL`` names a running server.
The server gets the ledger path through its environment: a stdio server inherits only a few
variables (PATH, HOME, ...), never the worker's DEX_* settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mcp import StdioServerParameters

from dex_tasks import ToolPolicy
from dex_tasks.integrations.mcp import mcp_tools
from workers import ledger

ROOT = Path(__file__).resolve().parent.parent

POLICIES: dict[str, ToolPolicy | str] = {
    # The server calls archive_order read-only; we know it is not (explicit beats annotation).
    "archive_order": "non_idempotent_write",
    # Destructive by its annotation, but the shop lets it run without a person (still once).
    "shop_ship_order": ToolPolicy(effect="non_idempotent_write", requires_approval=False),
}

URL = os.environ.get("DEX_TEST_MCP_URL")

if URL:
    tools = mcp_tools(URL, prefix="shop_", policies=POLICIES, headers={"X-Shop-Token": "t0ken"})
else:
    tools = mcp_tools(
        StdioServerParameters(command=sys.executable, args=["-m", "tests.mcp_server"],
                              cwd=str(ROOT), env={ledger.ENV: os.environ.get(ledger.ENV, "")}),
        prefix="shop_", policies=POLICIES,
    )
