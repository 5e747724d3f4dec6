"""Approvals: interrupts, their decisions and deadlines; the session snapshot.

A call that needs approval is stored ``awaiting_approval`` with an interrupt row (see
``DexClient.call_tool``); no Celery message exists for it, so it holds no worker and survives
any restart. This module decides interrupts:

* :func:`resolve_interrupt` - a person's decision. One transaction: a guarded ``UPDATE`` of the
  interrupt (undecided, in this session, deadline not passed) whose row count says whether this
  caller decided, and the call's guarded transition. The first decision wins; every later one,
  and one that arrives after the deadline, changes nothing.
* the deadline sweep (``store/deadlines.py``), run by beat, rejects calls whose deadline passed.

Both sides of a race (two people, a person and the sweep, two sweeps) guard on
``decision IS NULL`` in the same row, so exactly one wins.

Turns and messages: a user message sent while a turn of the session is open (one of its calls
is awaiting approval, queued or running) is stored ``queued`` and delivered when the turn ends;
see ``transcript.py``. What readers see of approvals (the snapshot, the pending list, why a
decision is refused) is ``session_views.py``'s; its names are importable from here too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Celery
from sqlalchemy import delete, insert, or_, select, update
from sqlalchemy.engine import Connection

from dex_tasks.agent.calls import checked_arguments
from dex_tasks.agent.session_views import (
    ALREADY_DECIDED,
    DEADLINE_PASSED,
    REFUSAL_REASONS,
    UNKNOWN_INTERRUPT,
    WRONG_SESSION,
    SnapshotWindow,
    get_interrupt,
    list_pending,
    refusal_reason,
    session_snapshot,
)
from dex_tasks.arguments import arguments_version
from dex_tasks.broker.celery_app import publish
from dex_tasks.errors import ForbiddenSessionError, InvalidArgumentError
from dex_tasks.limits import (
    APPROVER_MAX,
    INTERRUPT_ID_MAX,
    SESSION_ID_MAX,
    check_id,
    check_text,
)
from dex_tasks.registry import canonical_json
from dex_tasks.states import CallStatus
from dex_tasks.store import APPROVALS, CALLS, INTERRUPTS, Store, catalog, webhooks
from dex_tasks.store.deadlines import (
    APPROVAL_REJECTED,
    APPROVED,
    REJECTED,
)
from dex_tasks.store.records import edit_note
from dex_tasks.store.sqljson import same_json
from dex_tasks.store.tables import INSERT_EVENT
from dex_tasks.tracing import approvals_decided

# The readers' views (session_views.py) stay importable from here, as they always were.
__all__ = [
    "ALREADY_DECIDED", "APPROVAL_COUNTED", "APPROVAL_EDITED", "DEADLINE_PASSED",
    "REFUSAL_REASONS", "UNKNOWN_INTERRUPT", "WRONG_SESSION", "ApproverPermissionError",
    "InvalidEditError", "SelfApprovalError", "SnapshotWindow", "StaleApprovalError",
    "get_interrupt", "list_pending", "refusal_reason", "rejection_error", "resolve_interrupt",
    "session_snapshot",
]

log = logging.getLogger("dex_tasks.agent.approvals")

def rejection_error(approver: str | None, message: str | None) -> str:
    """The error a rejected call carries, which the model reads: who rejected it and why."""
    who = approver or "a reviewer"
    why = f": {message}" if message else " (no message given)"
    return f"{APPROVAL_REJECTED}: the tool did not run; rejected by {who}{why}"


APPROVAL_COUNTED = "tool_call_approval_counted"
"""The event of one approval of several that did not decide yet (the status stays)."""


class InvalidEditError(InvalidArgumentError):
    """Edited arguments a tool refuses (the message names the field), or an edit where none
    may be made (when rejecting). Nothing changed."""


class StaleApprovalError(InvalidArgumentError):
    """An approval of a version of the arguments that is no longer the call's (another approver
    edited them meanwhile), or one that names no version when they were edited. Nothing
    changed (HTTP 409); the message says the arguments changed and shows the current ones."""


class ApproverPermissionError(ForbiddenSessionError):
    """The approver's token does not hold the permission the call's policy names. Nothing
    changed (HTTP 403)."""


class SelfApprovalError(ApproverPermissionError):
    """The identity that made the call tried to decide it, and the tool's policy does not
    allow self-approval (``allow_self_approval``). Nothing changed (HTTP 403)."""


class _CallNotAwaiting(Exception):
    """The interrupt was undecided but its call is not awaiting approval: roll back."""


# -- a person's decision ------------------------------------------------------------------------


def resolve_interrupt(
    store: Store,
    app: Celery,
    session_id: str,
    interrupt_id: str,
    approved: bool,
    rejection_message: str | None = None,
    approver: str | None = None,
    now: float | None = None,
    *,
    arguments: Mapping[str, Any] | None = None,
    permissions: Sequence[str] | None = None,
    arguments_version: str | None = None,
    identity: str | None = None,
) -> bool:
    """Decide a pending approval; True if this call decided it (or, for a policy that needs
    several approvals, counted this approver's), False if it changed nothing.

    False for an interrupt already decided (by anyone, or expired by the sweep), one whose
    deadline has passed (even before the sweep ran), one that does not exist, one of another
    session, or a second approval by the same approver: safe to retry. Approving moves the call
    to ``queued`` and publishes it after the commit; if that publish fails the call stays
    ``queued`` and the stranded-call republisher sends it. Rejecting moves it to ``rejected``
    with :func:`rejection_error` as its error. ``rejection_message`` is ignored when approving.

    ``arguments`` (approving only): run the tool with these instead of the model's. They are
    validated against the tool's schema (:class:`InvalidEditError` naming the field, nothing
    changed); the call keeps both (``ToolCallRecord.original_arguments``), the event says
    what changed, and the model reads it (``ToolCallRecord.arguments_edit``).

    Several approvers (``ToolPolicy(approvals=N, approver_permission=...)``): each approval
    needs a named ``approver`` whose ``permissions`` hold the policy's permission
    (:class:`ApproverPermissionError` otherwise, nothing changed); the N-th distinct approver
    of the call's current arguments decides; the first rejection decides at once. An approval
    whose ``arguments`` differ from the current ones is an edit: the edited version needs N
    approvals of its own, the editor's the first (the earlier ones stay in the audit, event
    ``tool_call_arguments_edited``, and no longer count). ``arguments`` equal to the current
    ones approve exactly that version: a safe way to approve what one saw.

    ``arguments_version`` (approving only; ``PendingInterrupt.arguments_version``, which the
    session page sends with every decision): the version of the arguments the approver saw.
    An approval (or an edit) of a version that is no longer the call's raises
    :class:`StaleApprovalError` saying the arguments changed, and changes nothing. An approval
    that names no version (neither ``arguments_version`` nor ``arguments``) approves the
    model's arguments as they were asked: once an approver edited them, it is refused the
    same way, so no one's approval counts for a version they were not shown.
    Self-approval: a call records who made it (``call_tool(requested_by=...)``, the MCP
    server's client). A decision, approval or rejection, by that same identity (``identity``,
    else ``approver``) raises :class:`SelfApprovalError` and changes nothing, unless the tool's
    policy has ``allow_self_approval=True``.
    """
    check_id("session_id", session_id, SESSION_ID_MAX)
    check_id("interrupt_id", interrupt_id, INTERRUPT_ID_MAX)
    if not isinstance(approved, bool):
        raise InvalidArgumentError(f"approved must be a boolean, got {type(approved).__name__}")
    if rejection_message is not None:
        check_text("rejection_message", rejection_message)
    approver = approver or None
    if approver is not None:
        check_id("approver", approver, APPROVER_MAX)
    if arguments_version is not None:
        check_id("arguments_version", arguments_version, INTERRUPT_ID_MAX)
    edited: str | None = None
    if arguments is not None:
        if not approved:
            raise InvalidEditError("arguments can only be given when approving")
        try:
            _, edited = checked_arguments(arguments)
        except InvalidArgumentError as err:
            raise InvalidEditError(f"arguments: {err}") from None
    now = time.time() if now is None else now
    decision = APPROVED if approved else REJECTED
    reason = None if approved else (rejection_message or None)
    held = set(permissions or ())
    try:
        with store.write() as conn:
            # The compare-and-set of the decision: only an undecided interrupt of this session
            # whose deadline has not passed matches. This first UPDATE writes nothing new; it
            # takes the row's lock, so concurrent deciders (and approvers counting towards N)
            # serialise here and each sees the row as the one before it left it.
            row = conn.execute(
                update(INTERRUPTS)
                .where(
                    INTERRUPTS.c.interrupt_id == interrupt_id,
                    INTERRUPTS.c.session_id == session_id,
                    INTERRUPTS.c.decision.is_(None),
                    or_(INTERRUPTS.c.deadline_at.is_(None), INTERRUPTS.c.deadline_at > now),
                )
                .values(approvals_given=INTERRUPTS.c.approvals_given)
                .returning(INTERRUPTS.c.key, INTERRUPTS.c.approvals_required,
                           INTERRUPTS.c.approvals_given, INTERRUPTS.c.approver_permission,
                           INTERRUPTS.c.requested_by, INTERRUPTS.c.self_approval)
            ).first()
            if row is None:
                return False
            decider = identity or approver
            if (row.requested_by is not None and decider == row.requested_by
                    and not row.self_approval):
                raise SelfApprovalError(
                    f"{decider} made this call and may not decide it: a person decides (the "
                    "tool's policy does not set allow_self_approval)")
            key: str = row.key
            required = row.approvals_required or 1
            if row.approver_permission is not None and row.approver_permission not in held:
                raise ApproverPermissionError(
                    f"deciding this call needs the {row.approver_permission!r} permission, "
                    f"which {approver or 'this approver'}'s token does not hold")
            if approved:
                _check_version(conn, key, arguments_version, named=edited is not None)
            # Only a policy of several approvals has approval rows to read.
            approvers = _approvers(conn, interrupt_id) if required > 1 else []
            # The call's edit so far, for the deciding event (several approvals: an edit is
            # written when made, before the decision).
            audit: dict[str, Any] = {}
            if approved and required > 1:
                if approver is None:
                    raise InvalidArgumentError(
                        f"approver is required: this call needs {required} approvals from "
                        "distinct, named approvers")
                if edited is not None:
                    if _edit_restarts(store, conn, key, session_id, interrupt_id, edited,
                                      approver, approvers, required, now):
                        approvers = []
                    edited = None
                if approver in approvers:
                    return False
                conn.execute(insert(APPROVALS).values(interrupt_id=interrupt_id,
                                                      approver=approver, decided_at=now))
                approvers.append(approver)
                if len(approvers) < required:
                    _count_approval(store, conn, key, session_id, interrupt_id, approvers,
                                    required, now)
                    log.info("approval counted", extra={
                        "action": "interrupt_approval_counted", "key": key,
                        "interrupt_id": interrupt_id, "approver": approver,
                        "approvals": len(approvers), "required": required})
                    return True
                audit = _edit_so_far(conn, key)
            values: dict[str, Any] = {"published_at": now}
            detail: dict[str, Any] = {"reason": decision, "interrupt_id": interrupt_id,
                                      "approver": approver, **audit}
            if approvers:
                detail["approvers"] = approvers
            if edited is not None:
                original = conn.execute(select(CALLS.c.tool, CALLS.c.arguments)
                                        .where(CALLS.c.key == key)).first()
                if original is not None:
                    edited = _check_edit(store, original.tool, edited)
                if original is not None and not same_json(original.arguments, edited):
                    before = json.loads(original.arguments)
                    values.update(arguments=edited, original_arguments=original.arguments)
                    detail.update(original_arguments=before, arguments=json.loads(edited),
                                  edit=edit_note(before, json.loads(edited)))
            conn.execute(
                update(INTERRUPTS).where(INTERRUPTS.c.interrupt_id == interrupt_id)
                .values(decision=decision, decided_by=approver, decided_at=now, reason=reason,
                        approvals_given=len(approvers)))
            if approved:
                # published_at=now: the republisher leaves it alone while we publish below.
                # The call's queue expiry (``expires_in``) counts from now, not from the
                # request: time spent waiting for a person is not time spent in the queue.
                values["expires_at"] = CALLS.c.expires_at + (now - CALLS.c.created_at)
                moved = store.transition(
                    key, CallStatus.QUEUED, allowed={CallStatus.AWAITING_APPROVAL},
                    values=values, detail=detail, now=now, conn=conn,
                )
            else:
                moved = store.transition(
                    key, CallStatus.REJECTED, allowed={CallStatus.AWAITING_APPROVAL},
                    values={"error": rejection_error(approver, reason)}, detail=detail,
                    now=now, conn=conn,
                )
            if not moved:
                raise _CallNotAwaiting(key)
            webhooks.announce_keys(conn, store, webhooks.DECIDED, [key], now,
                                   {interrupt_id: approvers})
    except _CallNotAwaiting as err:
        log.error("interrupt undecided but its call is not awaiting approval",
                  extra={"action": "interrupt_inconsistent", "interrupt_id": interrupt_id,
                         "key": err.args[0]})
        return False
    log.info("interrupt resolved", extra={"action": "interrupt_resolved", "key": key,
                                          "interrupt_id": interrupt_id, "decision": decision,
                                          "approver": approver,
                                          "arguments_edited": edited is not None})
    approvals_decided(store, [key], decision, approver, now)  # OpenTelemetry, when on
    if approved:
        _publish_approved(store, app, key, now)
    return True


def _check_version(conn: Connection, key: str, version: str | None, *, named: bool) -> None:
    """:class:`StaleApprovalError` unless the approval is of the call's current arguments:
    ``version`` when given, else (``named`` False: no arguments given either) the model's
    arguments unedited. Read under the interrupt's lock, so no edit lands in between."""
    row = conn.execute(select(CALLS.c.arguments, CALLS.c.original_arguments)
                       .where(CALLS.c.key == key)).first()
    if row is None:
        return
    current = json.loads(row.arguments)
    now = arguments_version(current)
    if version is not None and version != now:
        raise StaleApprovalError(
            f"the arguments changed since you saw them (you saw version {version}; the call "
            f"now has version {now}, arguments {canonical_json(current)}): nothing was "
            "approved; look at the current arguments and decide again")
    if version is None and not named and row.original_arguments is not None:
        change = edit_note(json.loads(row.original_arguments), current)
        raise StaleApprovalError(
            f"the arguments changed since the model asked for them ({change}): nothing was "
            f"approved; approve naming the version you saw (arguments_version {now} is the "
            f"current one, arguments {canonical_json(current)})")


def _approvers(conn: Connection, interrupt_id: str) -> list[str]:
    return list(conn.execute(
        select(APPROVALS.c.approver).where(APPROVALS.c.interrupt_id == interrupt_id)
        .order_by(APPROVALS.c.decided_at, APPROVALS.c.approver)).scalars())


def _count_approval(store: Store, conn: Connection, key: str, session_id: str,
                    interrupt_id: str, approvers: list[str], required: int, now: float) -> None:
    """One approval of several, not yet the deciding one: counted on the interrupt, and an
    event row (the call's status does not change) so the audit and the page see it."""
    conn.execute(update(INTERRUPTS).where(INTERRUPTS.c.interrupt_id == interrupt_id)
                 .values(approvals_given=len(approvers)))
    conn.execute(INSERT_EVENT, {
        "session_id": session_id, "key": key, "event": APPROVAL_COUNTED,
        "from_status": CallStatus.AWAITING_APPROVAL.value,
        "to_status": CallStatus.AWAITING_APPROVAL.value,
        "detail": json.dumps({"interrupt_id": interrupt_id, "approver": approvers[-1],
                              "approvers": approvers, "required": required}),
        "created_at": now})


APPROVAL_EDITED = "tool_call_arguments_edited"
"""The event of an edit on a call that needs several approvals: the edited version waits for
its own approvals (the status stays); the event names the editor and the approvals the
previous version had, which no longer count."""


def _edit_restarts(store: Store, conn: Connection, key: str, session_id: str,
                   interrupt_id: str, edited: str, approver: str, approvers: list[str],
                   required: int, now: float) -> bool:
    """An approval with arguments of a call that needs several approvals, under the
    interrupt's lock. Arguments equal to the call's current ones approve that version (False:
    nothing restarted). Other arguments are an edit (True): checked against the tool's schema,
    written to the call, which keeps waiting, and the approval count starts again on the
    edited version, with the editor's approval its first. No one's approval counts for a
    version they did not approve; the event keeps the ones that no longer count."""
    row = conn.execute(select(CALLS.c.tool, CALLS.c.arguments, CALLS.c.original_arguments)
                       .where(CALLS.c.key == key)).first()
    if row is None:
        return False
    edited = _check_edit(store, row.tool, edited)
    if same_json(row.arguments, edited):
        return False
    new = json.loads(edited)
    asked = row.original_arguments or row.arguments  # the model's arguments
    moved = conn.execute(
        update(CALLS).where(CALLS.c.key == key,
                            CALLS.c.status == CallStatus.AWAITING_APPROVAL.value)
        .values(arguments=edited, updated_at=now,
                original_arguments=None if same_json(asked, edited) else asked))
    if moved.rowcount != 1:
        raise _CallNotAwaiting(key)
    conn.execute(delete(APPROVALS).where(APPROVALS.c.interrupt_id == interrupt_id))
    conn.execute(update(INTERRUPTS).where(INTERRUPTS.c.interrupt_id == interrupt_id)
                 .values(approvals_given=0))
    before = json.loads(row.arguments)
    conn.execute(INSERT_EVENT, {
        "session_id": session_id, "key": key, "event": APPROVAL_EDITED,
        "from_status": CallStatus.AWAITING_APPROVAL.value,
        "to_status": CallStatus.AWAITING_APPROVAL.value,
        "detail": json.dumps({"interrupt_id": interrupt_id, "approver": approver,
                              "previous_arguments": before, "arguments": new,
                              "edit": edit_note(before, new), "superseded": approvers,
                              "required": required}),
        "created_at": now})
    log.info("arguments edited; approvals start again", extra={
        "action": "interrupt_arguments_edited", "key": key, "interrupt_id": interrupt_id,
        "approver": approver, "superseded": len(approvers)})
    return True


def _edit_so_far(conn: Connection, key: str) -> dict[str, Any]:
    """The audit fields of a call's edit made before its deciding approval, if any."""
    row = conn.execute(select(CALLS.c.arguments, CALLS.c.original_arguments)
                       .where(CALLS.c.key == key)).first()
    if row is None or row.original_arguments is None:
        return {}
    before, after = json.loads(row.original_arguments), json.loads(row.arguments)
    return {"original_arguments": before, "arguments": after, "edit": edit_note(before, after)}


def _check_edit(store: Store, tool: str, edited: str) -> str:
    """Edited arguments (canonical JSON) normalized as a new call's are (``calls.new_call``):
    the JSON of what the tool will run with, which is what is compared, stored and judged.
    :class:`InvalidEditError` naming the fields (and values) the tool's schema refuses."""
    try:
        return canonical_json(catalog.lookup(store, tool).normalize(json.loads(edited)))
    except ValueError as err:  # InvalidArguments is one
        raise InvalidEditError(f"arguments: {err}") from None


def _publish_approved(store: Store, app: Celery, key: str, approved_at: float) -> None:
    call = store.get_call(key)
    if call is None or call.status != CallStatus.QUEUED.value:
        return
    try:
        publish(app, call)
    except Exception:  # noqa: BLE001 - it stays queued; the republisher sweep sends it
        log.warning("publish after approval failed; left for the republisher",
                    extra={"action": "approval_publish_failed", "key": key})
        # Never published, and said so: the republisher sends a call with no publish at its
        # next sweep once Redis answers, where the published_at of the approval would have
        # kept it waiting a whole window (5 minutes by default). Guarded on that value, so a
        # republish that landed meanwhile is not undone.
        try:
            with store.write() as conn:
                conn.execute(update(CALLS).where(
                    CALLS.c.key == key, CALLS.c.status == CallStatus.QUEUED.value,
                    CALLS.c.published_at == approved_at).values(published_at=None))
        except Exception:  # noqa: BLE001 - the republisher still sends it, a window later
            log.warning("could not mark an approved call unpublished",
                        extra={"action": "approval_publish_failed", "key": key})
