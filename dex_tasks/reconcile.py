"""Reconciliation: telling a session what really happened to its ``outcome_unknown`` calls.

An ``outcome_unknown`` call may or may not have taken effect, and dex-tasks never runs it
again. Someone has to ask the service the tool wrote to (by the call's idempotency key, which
every attempt passed to it) and tell the session the answer, so the model does not repeat a
charge that went through, or give up on one that did not. That answer goes into the session as a
user message ``"<answer> (tool call <key>)"``.

* :func:`report_unknown_outcomes` (a coroutine, the seeds' shape) does it for one session with
  an async ``check`` you pass, through any object with async ``get_agent_snapshot`` and
  ``send_user_message`` (:class:`~dex_tasks.AsyncDexClient` is one);
  :func:`report_unknown_outcomes_sync` is the same for a :class:`~dex_tasks.DexClient` and a
  plain ``check`` function.
* A tool may register its own checker with ``@my_tool.reconciler``;
  :func:`reconcile_with_reconcilers` runs those, for one session (``dex-tasks reconcile``) or
  for every session (the ``reconcile_unknown`` sweep, which runs in a worker, where the tool
  modules are imported).

One rule for all of them, the seeds' rule: a call whose key a user message of the session
already names has been reported, and is skipped. Each reads the transcript first and skips
those; when two race past that read, the store settles it: ``send_user_message`` stores a report
of an unknown outcome only if no user message of the session names its key yet, checked under
a per-session lock in the transaction that would store it (``transcript.add_user_message``).
So the seeds' own sample, run against ``AsyncDexClient``, shares the rule too. A checker that
returns ``None`` (or an empty text) does not know yet; the call is asked about again next time.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import select

from dex_tasks.errors import DexError
from dex_tasks.models import ToolCallRow
from dex_tasks.records import AgentSnapshot
from dex_tasks.registry import Tool, local_tools
from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store import CALLS, Store
from dex_tasks.transcript import named_keys, names_key, report_text, send_user_message

log = logging.getLogger("dex_tasks.reconcile")

OutcomeCheck = Callable[[str, str], Awaitable[str | None]]
"""``async check(idempotency_key, arguments_json) -> report text`` (None: not known yet)."""

SyncOutcomeCheck = Callable[[str, str], str | None]
"""``check(idempotency_key, arguments_json) -> report text or None`` (None: not known yet)."""

PAGE = 200


class InvalidCheckResultError(DexError):
    """A checker returned something other than a text or None."""


class SessionMessenger(Protocol):
    """What :func:`report_unknown_outcomes` needs: the seeds' two session methods, async."""

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot: ...

    async def send_user_message(self, session_id: str, text: str) -> bool: ...


class SyncSessionMessenger(Protocol):
    """What :func:`report_unknown_outcomes_sync` needs (:class:`~dex_tasks.DexClient` has it)."""

    def get_agent_snapshot(self, session_id: str) -> AgentSnapshot: ...

    def send_user_message(self, session_id: str, text: str) -> bool: ...


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


def unreported_in(snapshot: AgentSnapshot) -> list[tuple[str, str]]:
    """``(key, arguments_json)`` of each ``outcome_unknown`` tool message of the transcript
    whose key no user message names, oldest first."""
    sent = [m.text for m in snapshot.messages if m.role is MessageRole.USER]
    found = []
    for message in snapshot.messages:
        if message.role is not MessageRole.TOOL or (
                message.call_status is not CallStatus.OUTCOME_UNKNOWN):
            continue
        key = message.key or f"{snapshot.session_id}/{message.turn_id}/{message.tool_call_id}"
        if not any(names_key(text, key) for text in sent):
            found.append((key, message.tool_arguments or "{}"))
    return found


async def report_unknown_outcomes(
    sessions: SessionMessenger, session_id: str, check: OutcomeCheck | SyncOutcomeCheck
) -> list[str]:
    """Tell the session what really happened to each of its ``outcome_unknown`` calls.

    Reads the transcript with ``await sessions.get_agent_snapshot(session_id)``; for each
    ``outcome_unknown`` tool message whose key no user message of the session names yet, asks
    ``await check(idempotency_key, arguments_json)`` and sends the answer with
    ``await sessions.send_user_message(session_id, "<answer> (tool call <key>)")``. An answer of
    None (or empty) means "not known yet": nothing is sent and the call is asked about next
    time. Returns the reports the session stored (a report another reconciler beat us to is
    refused by the store and left out), so running it again sends nothing new.

    ``sessions`` is anything with those two coroutines, :class:`~dex_tasks.AsyncDexClient`
    among them. A plain (non-async) ``check`` is accepted too.
    """
    snapshot = await sessions.get_agent_snapshot(session_id)
    reports: list[str] = []
    for key, arguments_json in unreported_in(snapshot):
        value: object = check(key, arguments_json)
        if inspect.isawaitable(value):
            value = await value
        answer = _answer(value)
        if answer is None:
            continue
        text = report_text(key, answer)
        if await sessions.send_user_message(session_id, text):
            reports.append(text)
    return reports


def report_unknown_outcomes_sync(
    client: SyncSessionMessenger, session_id: str, check: SyncOutcomeCheck
) -> list[str]:
    """:func:`report_unknown_outcomes` for a :class:`~dex_tasks.DexClient` and a plain
    ``check(idempotency_key, arguments_json) -> str | None``: the same rule, no event loop.

    Each report is committed on its own, so if ``check`` raises, the reports before it stand
    and running the function again carries on where it stopped.
    """
    reports: list[str] = []
    for key, arguments_json in unreported_in(client.get_agent_snapshot(session_id)):
        value: object = check(key, arguments_json)
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never awaited: close it rather than leave a warning behind
            raise InvalidCheckResultError(
                "the check returned an awaitable: use the async report_unknown_outcomes for an "
                "async check"
            )
        answer = _answer(value)
        if answer is None:
            continue
        text = report_text(key, answer)
        if client.send_user_message(session_id, text):
            reports.append(text)
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
    """``outcome_unknown`` calls whose key no user message of their session names yet, oldest
    first, read a page at a time."""
    after: tuple[float, str] | None = None
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
            rows = [ToolCallRow.model_validate(dict(r)) for r in conn.execute(stmt).mappings()]
            reported = named_keys(conn, [(r.session_id, r.key) for r in rows])
        yield from (row for row in rows if row.key not in reported)
        if len(rows) < PAGE:
            return
        last = rows[-1]
        after = (last.finished_at or 0.0, last.key)


def _answer(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidCheckResultError(
            f"a reconciliation check must return a str or None, got {type(value).__name__}"
        )
    return value if value.strip() else None


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
