"""Tools whose ending the store cannot hold as it is (issue 19, finding 2).

A worker imports this module with ``--tools tests.review_tools``. Each records its execution in
the ledger, so a test can tell that it ran exactly once.
"""

from __future__ import annotations

import time
from typing import Any

from dex_tasks import OutcomeUnknownError, ToolContext, tool
from workers import ledger


class Unprintable(Exception):
    """An exception whose ``__str__`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for this error")


@tool(effect="read", max_attempts=3)
def nul_error(ctx: ToolContext) -> dict[str, Any]:
    """Fails with a NUL character in its message (PostgreSQL text cannot hold it)."""
    ledger.record("nul_error", ctx.idempotency_key, ctx.attempt)
    raise ValueError("bad\x00byte from the backend")


@tool(effect="read", max_attempts=3)
def surrogate_error(ctx: ToolContext) -> dict[str, Any]:
    """Fails with a lone surrogate in its message (not valid Unicode: neither engine holds it)."""
    ledger.record("surrogate_error", ctx.idempotency_key, ctx.attempt)
    raise ValueError("bad \udc80 text from the backend")


@tool(effect="read", max_attempts=3)
def deep_result(ctx: ToolContext, depth: int) -> Any:
    """Returns lists nested ``depth`` deep."""
    ledger.record("deep_result", ctx.idempotency_key, ctx.attempt)
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@tool(effect="non_idempotent_write", requires_approval=False)
def unprintable_error(ctx: ToolContext) -> dict[str, Any]:
    """A write that fails with an exception whose ``__str__`` raises."""
    ledger.record("unprintable_error", ctx.idempotency_key, ctx.attempt)
    raise Unprintable()


@tool(effect="non_idempotent_write", requires_approval=False)
def unsure_slow_check(ctx: ToolContext, n: int) -> dict[str, Any]:
    """A write that always ends outcome_unknown; its checker is slow and never knows."""
    ledger.record("unsure_slow_check", ctx.idempotency_key, ctx.attempt)
    raise OutcomeUnknownError("the provider dropped the connection")


@unsure_slow_check.reconciler
def _slow_check(key: str, arguments: dict[str, Any]) -> str | None:
    started = time.time()
    time.sleep(CHECK_SECONDS)
    ledger.record("check", f"check:{key}", 0, started=started, ended=time.time())
    return None


CHECK_SECONDS = 0.1
