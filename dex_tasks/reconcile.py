"""Reconciliation: telling a session what really happened to its ``outcome_unknown`` calls.

An ``outcome_unknown`` call may or may not have taken effect, and dex-tasks never runs it
again. Someone has to ask the service the tool wrote to (by the call's idempotency key, which
every attempt passed to it) and tell the session the answer, so the model does not repeat a
charge that went through, or give up on one that did not. That answer goes into the session as a
user message naming the key.

* :func:`report_unknown_outcomes` does it for one session with a ``check`` function you pass.
* A tool may register its own checker with ``@my_tool.reconciler``;
  :func:`reconcile_with_reconcilers` runs those, for one session (``dex-tasks reconcile``) or
  for every session (the ``reconcile_unknown`` sweep, which runs in a worker, where the tool
  modules are imported).

Each report is recorded in ``dex_reconciliations`` (keyed by the call) in the same transaction
as its message, so a call is reported at most once: running either again sends nothing new, and
when two run at once the second insert fails and its message is rolled back. A checker that
returns ``None`` (or an empty text) does not know yet; the call is asked about again next time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import exists, insert, select
from sqlalchemy.exc import IntegrityError

from dex_tasks.approvals import add_message
from dex_tasks.errors import DexError
from dex_tasks.models import ReconciliationRow, ToolCallRow
from dex_tasks.registry import Tool, local_tools
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, Store, readable_calls

if TYPE_CHECKING:
    from dex_tasks.client import DexClient

log = logging.getLogger("dex_tasks.reconcile")

RECONCILIATIONS = ReconciliationRow.__table__  # type: ignore[attr-defined]

OutcomeCheck = Callable[[str, str], str | None]
"""``check(idempotency_key, arguments_json) -> report text or None`` (None: not known yet)."""

PAGE = 200


class InvalidCheckResultError(DexError):
    """A checker returned something other than a text or None."""


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


def report_text(key: str, answer: str) -> str:
    """The message sent into the session: the checker's answer, naming the call's key."""
    return f"{answer.strip()} (tool call {key})"


def report_unknown_outcomes(
    client: DexClient, session_id: str, check: OutcomeCheck
) -> list[str]:
    """Tell the session what really happened to each of its ``outcome_unknown`` calls.

    For every such call not reported before (oldest first), asks
    ``check(idempotency_key, arguments_json)``; a text answer is sent into the session as a user
    message naming the key (queued while a turn of the session is open), and recorded so that no
    later run reports the call again. ``None`` means "not known yet": nothing is sent and the
    call is asked about next time. Returns the reports this run sent.

    Each report is committed on its own, so if ``check`` raises, the reports before it stand and
    running the function again carries on where it stopped.
    """
    reports: list[str] = []
    for call in unreported_calls(client.store, session_id=session_id):
        report = _report_one(client.store, call, _answer(check(call.key, call.arguments)),
                             checker="check")
        if report is not None:
            reports.append(report.text)
    return reports


def reconciler_for(tool_name: str) -> Callable[[str, dict[str, Any]], str | None] | None:
    """The checker registered with ``@tool.reconciler`` for ``tool_name`` in this process."""
    registered: Tool[Any] | None = local_tools().get(tool_name)
    return registered.reconcile_fn if registered is not None else None


def reconcile_with_reconcilers(
    store: Store, session_id: str | None = None, now: float | None = None
) -> ReconcileResult:
    """Run the tools' registered checkers for unreported ``outcome_unknown`` calls.

    With ``session_id``, looks at that session's calls (and lists the ones whose tool has no
    checker here); without it, at every session's calls of tools that have a checker in this
    process (the sweep). A checker that raises is logged and skipped; the others still run.
    """
    result = ReconcileResult()
    tools = None
    if session_id is None:
        tools = sorted(name for name, t in local_tools().items() if t.reconcile_fn is not None)
        if not tools:
            return result
    for call in unreported_calls(store, session_id=session_id, tools=tools):
        fn = reconciler_for(call.tool)
        if fn is None:
            result.no_checker.append(call.key)
            continue
        try:
            answer = _answer(fn(call.key, json.loads(call.arguments)))
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
    return result


def unreported_calls(
    store: Store, *, session_id: str | None = None, tools: Iterable[str] | None = None
) -> Iterator[ToolCallRow]:
    """``outcome_unknown`` calls with no report yet, oldest first, read a page at a time."""
    after: tuple[float, str] | None = None
    while True:
        stmt = select(CALLS).where(
            CALLS.c.status == CallStatus.OUTCOME_UNKNOWN.value,
            ~exists().where(RECONCILIATIONS.c.key == CALLS.c.key),
        )
        if session_id is not None:
            stmt = stmt.where(CALLS.c.session_id == session_id)
        if tools is not None:
            stmt = stmt.where(CALLS.c.tool.in_(list(tools)))
        if after is not None:
            # Keyset paging: a call reported meanwhile drops out without shifting the pages.
            stmt = stmt.where(
                (CALLS.c.finished_at > after[0])
                | ((CALLS.c.finished_at == after[0]) & (CALLS.c.key > after[1]))
            )
        stmt = stmt.order_by(CALLS.c.finished_at, CALLS.c.key).limit(PAGE)
        with store.read() as conn:
            page = conn.execute(stmt).mappings().all()
        rows = readable_calls(page)
        yield from rows
        if len(page) < PAGE:
            return
        last = page[-1]
        after = (last["finished_at"] or 0.0, last["key"])


def _answer(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCheckResultError(
            f"a reconciliation check must return a str or None, got {type(value).__name__}"
        )
    return value if value.strip() else None


def _report_one(
    store: Store, call: ToolCallRow, answer: str | None, *, checker: str,
    now: float | None = None,
) -> Report | None:
    """Send and record one report; None if there is no answer or another run reported first."""
    if answer is None:
        return None
    text = report_text(call.key, answer)
    now = time.time() if now is None else now
    try:
        with store.write() as conn:
            # In our transaction: the message and the record that the call was reported
            # commit (or fail) together.
            message_id = add_message(conn, call.session_id, text, now)
            conn.execute(insert(RECONCILIATIONS).values(
                key=call.key, session_id=call.session_id, message_id=message_id,
                checker=checker[:255], report=text, reported_at=now,
            ))
    except IntegrityError:
        # Another run reported this call first; our message was rolled back with the insert.
        log.info("already reported", extra={"action": "reconcile_duplicate", "key": call.key})
        return None
    log.info("unknown outcome reported",
             extra={"action": "outcome_reconciled", "key": call.key,
                    "session_id": call.session_id, "checker": checker, "message_id": message_id})
    return Report(key=call.key, session_id=call.session_id, tool=call.tool, text=text,
                  message_id=message_id)
