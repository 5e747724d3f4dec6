"""A catalog of many no-op ``read`` tools, for ``python -m bench tools``.

How many is read from ``DEX_BENCH_TOOL_COUNT`` when the module is imported (a worker started
with ``--tools bench.catalog_tools`` defines that many): ``bench_tool_000``,
``bench_tool_001``... An MCP server can bring hundreds of tools to one worker; this stands in
for it without a server.
"""

from __future__ import annotations

import os

from dex_tasks import ToolContext, tool

COUNT_ENV = "DEX_BENCH_TOOL_COUNT"


def tool_name(index: int) -> str:
    """The name of the ``index``-th tool of the catalog."""
    return f"bench_tool_{index:03d}"


def _noop(ctx: ToolContext) -> None:
    return None


for _index in range(int(os.environ.get(COUNT_ENV, "5"))):
    tool(effect="read", name=tool_name(_index))(_noop)
