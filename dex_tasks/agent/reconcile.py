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
  ``worker/reconcilers.py`` runs those, for one session (``dex-tasks reconcile``) or
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
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store.records import AgentSnapshot
from dex_tasks.store.transcript import (
    InvalidCheckResultError,
    checked_answer,
    names_key,
    report_text,
)

log = logging.getLogger("dex_tasks.agent.reconcile")

OutcomeCheck = Callable[[str, str], Awaitable[str | None]]
"""``async check(idempotency_key, arguments_json) -> report text`` (None: not known yet)."""

SyncOutcomeCheck = Callable[[str, str], str | None]
"""``check(idempotency_key, arguments_json) -> report text or None`` (None: not known yet)."""

class SessionMessenger(Protocol):
    """What :func:`report_unknown_outcomes` needs: the seeds' two session methods, async."""

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot: ...

    async def send_user_message(self, session_id: str, text: str) -> bool: ...


class SyncSessionMessenger(Protocol):
    """What :func:`report_unknown_outcomes_sync` needs (:class:`~dex_tasks.DexClient` has it)."""

    def get_agent_snapshot(self, session_id: str) -> AgentSnapshot: ...

    def send_user_message(self, session_id: str, text: str) -> bool: ...


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
        answer = checked_answer(value)
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
        answer = checked_answer(value)
        if answer is None:
            continue
        text = report_text(key, answer)
        if client.send_user_message(session_id, text):
            reports.append(text)
    return reports


