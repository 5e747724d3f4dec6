"""The I/O-bound tool of the I/O benchmark: it waits, as a tool calling an HTTP service does.

Started as ``dex-tasks worker --tools bench.io_tools --pool threads -c 200``.
"""

from __future__ import annotations

import time

from bench.infra import IO_TOOL
from dex_tasks import ToolContext, tool


@tool(effect="read", name=IO_TOOL)
def bench_io_sleep(ctx: ToolContext, seconds: float = 1.0) -> None:
    """Waits ``seconds`` (a read: an I/O-bound lookup)."""
    time.sleep(seconds)
