"""Tools that misbehave at the edges: odd ``retry_after`` hints, and exceptions that are not
``Exception``s (or that look like Celery's own).

A worker imports this module with ``--tools workers.example_tools,tests.edge_tools``.
"""

from __future__ import annotations

import os

from billiard.exceptions import WorkerLostError
from celery.exceptions import Ignore

from dex_tasks import ToolContext, TransientToolError, tool
from workers import ledger


class Abort(BaseException):
    """A custom ``BaseException``, as some libraries raise to unwind (not an ``Exception``)."""


def _raise(kind: str, message: str) -> None:
    if kind == "keyboard_interrupt":
        raise KeyboardInterrupt(message)
    if kind == "custom":
        raise Abort(message)
    if kind == "system_exit":
        raise SystemExit(3)
    if kind == "worker_lost":
        # Celery's own exception for a lost child, raised by the tool itself.
        raise WorkerLostError(message)
    if kind == "ignore":
        raise Ignore(message)
    raise ValueError(f"unknown kind {kind!r}")


@tool(effect="non_idempotent_write", requires_approval=False)
def base_charge(ctx: ToolContext, kind: str) -> dict[str, object]:
    """A charge that raises the exception named by ``kind`` (see ``_raise``)."""
    ledger.record("base_charge", ctx.idempotency_key, ctx.attempt)
    _raise(kind, f"charge stopped by {kind}")
    return {}


@tool(effect="read", max_attempts=3)
def base_lookup(ctx: ToolContext, kind: str) -> dict[str, object]:
    """A read that raises the exception named by ``kind`` on every attempt."""
    ledger.record("base_lookup", ctx.idempotency_key, ctx.attempt)
    _raise(kind, f"lookup stopped by {kind}")
    return {}


@tool(effect="read", max_attempts=2)
def hinted_lookup(ctx: ToolContext, retry_after: str) -> dict[str, object]:
    """A read whose first attempt asks to be retried after ``float(retry_after)`` seconds.

    The hint is a string so that ``inf`` and ``nan`` can travel in JSON arguments.
    """
    ledger.record("hinted_lookup", ctx.idempotency_key, ctx.attempt)
    if ctx.attempt == 1:
        raise TransientToolError("rate limited", retry_after=float(retry_after))
    return {"attempt": ctx.attempt, "pid": os.getpid()}


@tool(effect="read")
def whoami(ctx: ToolContext) -> dict[str, object]:
    """Which child ran the call (to tell whether a child survived an earlier call)."""
    ledger.record("whoami", ctx.idempotency_key, ctx.attempt)
    return {"pid": os.getpid()}
