"""A tool whose result the store cannot hold as it is, for ``test_store_types``.

A worker imports this module with ``--tools tests.storage_tools``.
"""

from __future__ import annotations

from dex_tasks import ToolContext, tool


@tool(effect="read", max_attempts=1)
def nul_text(ctx: ToolContext, before: str, after: str) -> dict[str, str]:
    """Returns a text with a NUL character in it (a binary blob decoded as text, say)."""
    return {"text": f"{before}\x00{after}"}
