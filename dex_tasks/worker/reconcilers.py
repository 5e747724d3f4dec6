"""The tools' own checkers of unknown outcomes (``@tool.reconciler``), run where tool code is.

The ``reconcile_unknown`` sweep runs in a worker (the tool modules are imported there) and
``dex-tasks reconcile`` runs them for one session. They follow the one reconciliation rule of
``store/transcript.py``, shared with :func:`dex_tasks.report_unknown_outcomes`: a call whose key
a user message of its session already names is skipped, and the store refuses a second report
under the session's lock.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from dex_tasks.registry import Tool, local_tools
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, Store, readable_calls
from dex_tasks.store.models import ToolCallRow
from dex_tasks.store.transcript import checked_answer, named_keys, report_text, send_user_message

log = logging.getLogger("dex_tasks.worker.reconcilers")

PAGE = 200


@dataclass(frozen=True)
class Report:
    """One report sent into a session."""

    key: str
    session_id: str
    tool: str
    text: str
    message_id: int


@dataclass
class ReconcileResult:
    """What one reconciliation pass did."""

    reported: list[Report] = field(default_factory=list)
    # Keys of outcome_unknown calls whose tool has no reconciler in this process.
    no_checker: list[str] = field(default_factory=list)
    # Keys whose checker did not know yet (returned None).
    unanswered: list[str] = field(default_factory=list)
    # Keys whose checker raised, with the error.
    failed: dict[str, str] = field(default_factory=dict)
    # With ``limit``: where the pass stopped (the last call it looked at, as ``unreported_calls``
    # pages), or None when it went through every call.
    stopped_after: tuple[float, str] | None = None


def reconciler_for(tool_name: str) -> Callable[[str, dict[str, Any]], str | None] | None:
    """The checker registered with ``@tool.reconciler`` for ``tool_name`` in this process."""
    registered: Tool[Any] | None = local_tools().get(tool_name)
    return registered.reconcile_fn if registered is not None else None


def reconcile_with_reconcilers(
    store: Store, session_id: str | None = None, now: float | None = None, *,
    after: tuple[float, str] | None = None, limit: int | None = None,
) -> ReconcileResult:
    """Run the tools' registered checkers for unreported ``outcome_unknown`` calls.

    With ``session_id``, looks at that session's calls (and lists the ones whose tool has no
    checker here); without it, at every session's calls of tools that have a checker in this
    process (the sweep). A checker that raises is logged and skipped; the others still run.
    ``after`` starts past that call (``stopped_after`` of an earlier pass), and ``limit``
    asks at most that many checkers, so that one pass is bounded however slow they are.
    """
    result = ReconcileResult()
    tools = None
    if session_id is None:
        tools = sorted(name for name, t in local_tools().items() if t.reconcile_fn is not None)
        if not tools:
            return result
    asked = 0
    for call in unreported_calls(store, session_id=session_id, tools=tools, after=after):
        if limit is not None and asked >= limit:
            return result
        asked += 1
        result.stopped_after = (call.finished_at or 0.0, call.key) if limit is not None else None
        fn = reconciler_for(call.tool)
        if fn is None:
            result.no_checker.append(call.key)
            continue
        try:
            answer = checked_answer(fn(call.key, json.loads(call.arguments)))
        except Exception as err:  # one broken checker must not stop the rest
            log.warning("reconciler failed", exc_info=True,
                        extra={"action": "reconciler_error", "key": call.key, "tool": call.tool})
            result.failed[call.key] = f"{type(err).__name__}: {err}"
            continue
        if answer is None:
            result.unanswered.append(call.key)
            continue
        report = _report_one(store, call, answer, checker=f"reconciler:{call.tool}", now=now)
        if report is not None:
            result.reported.append(report)
    result.stopped_after = None
    return result


def unreported_calls(
    store: Store, *, session_id: str | None = None, tools: Iterable[str] | None = None,
    after: tuple[float, str] | None = None,
) -> Iterator[ToolCallRow]:
    """``outcome_unknown`` calls whose key no user message of their session names yet, oldest
    first (past ``after``, a ``(finished_at, key)``), read a page at a time."""
    while True:
        stmt = select(CALLS).where(CALLS.c.status == CallStatus.OUTCOME_UNKNOWN.value)
        if session_id is not None:
            stmt = stmt.where(CALLS.c.session_id == session_id)
        if tools is not None:
            stmt = stmt.where(CALLS.c.tool.in_(list(tools)))
        if after is not None:
            # Keyset paging: a call reported meanwhile does not shift the pages.
            stmt = stmt.where(
                (CALLS.c.finished_at > after[0])
                | ((CALLS.c.finished_at == after[0]) & (CALLS.c.key > after[1]))
            )
        stmt = stmt.order_by(CALLS.c.finished_at, CALLS.c.key).limit(PAGE)
        with store.read() as conn:
            page = conn.execute(stmt).mappings().all()
            rows = readable_calls(page)
            reported = named_keys(conn, [(r.session_id, r.key) for r in rows])
        yield from (row for row in rows if row.key not in reported)
        if len(page) < PAGE:
            return
        last = page[-1]
        after = (last["finished_at"] or 0.0, last["key"])


def _report_one(
    store: Store, call: ToolCallRow, answer: str, *, checker: str, now: float | None = None,
) -> Report | None:
    """Send one report; None if another reconciler reported the call first."""
    text = report_text(call.key, answer)
    message = send_user_message(store, call.session_id, text,
                                time.time() if now is None else now)
    if message is None:
        return None
    log.info("unknown outcome reported",
             extra={"action": "outcome_reconciled", "key": call.key,
                    "session_id": call.session_id, "checker": checker,
                    "message_id": message.id})
    return Report(key=call.key, session_id=call.session_id, tool=call.tool, text=text,
                  message_id=message.id)
