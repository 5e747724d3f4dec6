"""The no-op tools the dex-tasks side of the benchmarks calls.

Started as ``dex-tasks worker --tools bench.noop_tools -c 2``. The agent side does not import
this module: like a real agent process it takes the policy from the catalog the worker
published.
"""

from __future__ import annotations

from bench.infra import READ_TOOL, SINGLE_ATTEMPT_TOOL
from dex_tasks import ToolContext, tool


@tool(effect="read", name=READ_TOOL)
def bench_noop_read(ctx: ToolContext) -> None:
    """Does nothing (a read: retrying path, acknowledged late)."""
    return None


@tool(effect="non_idempotent_write", requires_approval=False, name=SINGLE_ATTEMPT_TOOL)
def bench_noop_write(ctx: ToolContext) -> None:
    """Does nothing (a non-idempotent write without approval: single-attempt path)."""
    return None
