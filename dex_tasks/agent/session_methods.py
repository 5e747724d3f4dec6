"""What a :class:`~dex_tasks.agent.client.DexClient` does with a session besides recording
calls: read a call, wait for it to end, the session's snapshot, approvals, messages and
durable turns.

:class:`SessionMethods` is a base class of ``DexClient``, which supplies the store, the
settings and the Celery app; the methods here only delegate to the modules that own each job
(``approvals``, ``transcript``, ``turns``), so that ``client.py`` keeps the call path (recording,
publishing, the catalog) and each module one role.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dex_tasks.agent import hints
from dex_tasks.errors import CallNotFoundError
from dex_tasks.lazy import Deferred
from dex_tasks.states import CallStatus

# Celery, SQLAlchemy and Redis are imported when first used, not with this module (see
# dex_tasks.lazy): ``from dex_tasks import DexClient`` stays cheap.
if TYPE_CHECKING:
    from dex_tasks.agent import approvals, session_views, turns
    from dex_tasks.broker import ended, metrics, notify
    from dex_tasks.broker.redis_clients import connector
    from dex_tasks.store import transcript
    from dex_tasks.store.models import ToolCallRow
    from dex_tasks.store.records import CallEvent, ToolCallRecord
else:
    _deferred = Deferred(globals())
    approvals, session_views, turns = _deferred("dex_tasks.agent", "approvals", "session_views",
                                                  "turns")
    ended, metrics, notify = _deferred("dex_tasks.broker", "ended", "metrics", "notify")
    connector = _deferred("dex_tasks.broker.redis_clients", "connector")
    transcript = _deferred("dex_tasks.store", "transcript")
    ToolCallRow = _deferred("dex_tasks.store.models", "ToolCallRow")
    CallEvent, ToolCallRecord = _deferred("dex_tasks.store.records", "CallEvent",
                                          "ToolCallRecord")

# How wait polls the store while notifications cannot reach it (the watcher is not connected):
# the first pause, doubled up to the last.
FAST_POLL_FIRST = 0.005
FAST_POLL_MAX = 0.2


class SessionMethods:
    """Reads, waits, approvals, messages and durable turns of :class:`DexClient` (its base
    class: see the module's docstring)."""

    store: hints.Store
    settings: hints.DexSettings
    _watcher: hints.CallWatcher | None = None
    # Checks the ended records notifications hand to ``wait`` (made on the first wake-up).
    _signer: ended.RecordSigner | None = None

    @property
    def app(self) -> hints.Celery:
        """The Celery app used to publish (``DexClient`` creates it on first use)."""
        raise NotImplementedError

    @property
    def watcher(self) -> hints.CallWatcher:
        """The Redis subscription ``wait`` is woken through (started on first use)."""
        if self._watcher is None:
            self._watcher = notify.CallWatcher(connector(self.settings))
        return self._watcher

    def _handed(self, watch: Any, key: str) -> hints.ToolCallRecord | None:
        """The ended record the notification that woke ``watch`` carried (signed with the
        store's key, checked here), or None: then the store is read."""
        if self._signer is None:
            self._signer = ended.RecordSigner(self.store)
        record = ended.ended_record(watch.message, self._signer.serializer(), key)
        if record is None:
            return None
        handed = ToolCallRecord.from_mapping(record)
        return handed if handed.terminal else None

    def _sending(self, session_id: str) -> int | None:
        """Before a call of ``session_id`` is recorded: the watcher's confirmation that its
        end will be heard (``notify.CallWatcher.sending``), for :meth:`_sent`. Only once this
        client has waited: one that never waits opens no subscription for it."""
        watcher = self._watcher
        return watcher.sending(session_id) if watcher is not None else None

    def _sent(self, key: str, session_id: str, confirmed: int | None) -> None:
        """Call ``key`` was recorded under ``confirmed`` (:meth:`_sending`): its end is kept
        for its ``wait``, which then reads nothing (``notify.CallWatcher.sent``)."""
        if confirmed is not None and self._watcher is not None:
            self._watcher.sent(key, session_id, confirmed)

    def _watch_sent(self, key: str, on_wake: Any = None) -> Any:
        """The watcher's watch of call ``key`` if this client sent it and cannot miss its end
        (``notify.CallWatcher.watch_sent``), else None."""
        watcher = self._watcher
        return watcher.watch_sent(key, on_wake) if watcher is not None else None

    def _stop_watching(self) -> None:
        """Close the watcher, if ``wait`` started one (part of ``DexClient.close``)."""
        if self._watcher is not None:
            self._watcher.close()

    def get_tool_call(self, key: str) -> hints.ToolCallRecord:
        """The call's record; :class:`CallNotFoundError` if no call has that key.

        A call of the retrying path that a worker runs now is ``queued`` in the store and
        ``running`` under a lease in Redis (``broker/runs.py``): it is shown ``running``."""
        record = self._stored_call(key)
        if record.status is CallStatus.QUEUED:
            return metrics.shown_runs(self.settings).overlay([record])[0]
        return record

    def _stored_call(self, key: str) -> hints.ToolCallRecord:
        row = self.store.get_call_columns(key)
        if row is None:
            raise CallNotFoundError(key)
        return ToolCallRecord.from_mapping(row)

    def wait(self, key: str, timeout: float = 30.0) -> hints.ToolCallRecord:
        """Block until the call is terminal and return it; ``TimeoutError`` after ``timeout``.

        Woken by the Redis notification sent when the call ends (see ``notify.py``), which
        hands over the ended record (signed with the store's key, checked here), so it is
        in hand as soon as it is stored, with no read of the store. Without a notification
        that carried it, the store is read on every wake-up, and every
        ``wait_poll_seconds`` regardless, in case a notification was lost; while Redis cannot
        be reached it is read every 5 ms, doubling up to 200 ms.
        """
        pauses = WaitPauses(key, timeout, self.settings.wait_poll_seconds)
        sent = self._watch_sent(key)
        if sent is not None:
            # A call this client sent while its session's ends reached it: no read first.
            with sent:
                while sent.message is None and sent.covered:
                    pause = pauses.next(live=True)
                    if pause is None or not sent.wait(pause):
                        break  # time is up, or a poll is due: the store says
            handed = self._handed(sent, key) if sent.message is not None else None
            if handed is not None:
                return handed
        # The store alone: a waiter waits for the end, and only its timeout's answer needs
        # a running attempt shown as running (Redis, ``get_tool_call``).
        record = self._stored_call(key)
        if record.terminal:
            return record
        with self.watcher.watch(key) as watch:
            while True:
                pause = pauses.next(watch.live)
                if pause is None:
                    return pauses.timed_out(self.get_tool_call(key))
                watch.wait(pause)
                handed = self._handed(watch, key)
                if handed is not None:
                    return handed
                record = self._stored_call(key)
                if record.terminal:
                    return record

    def get_agent_snapshot(self, session_id: str) -> hints.AgentSnapshot:
        """The session as one consistent read: ``.tool_calls``, ``.messages`` (the transcript:
        user, assistant and tool messages, oldest first), ``.pending_interrupts`` (approvals
        waiting, deadline not passed) and ``.decided`` (who decided each past approval, when,
        and why)."""
        return session_views.session_snapshot(self.store, session_id,
                                              runs=metrics.shown_runs(self.settings))

    # -- approvals and messages -----------------------------------------------------------------

    def resolve_interrupt(
        self,
        session_id: str,
        interrupt_id: str,
        approved: bool,
        rejection_message: str | None = None,
        approver: str | None = None,
        arguments: Mapping[str, Any] | None = None,
        permissions: Sequence[str] | None = None,
        arguments_version: str | None = None,
        identity: str | None = None,
    ) -> bool:
        """Approve or reject a pending call; True if this call decided, False otherwise.

        The first decision wins; a later one, one after the deadline, or one for an unknown
        interrupt or another session returns False and changes nothing (safe to retry).
        Approving runs the call; rejecting ends it ``rejected`` with ``rejection_message`` in
        its error, where the model reads it. ``arguments``: approve with these instead (edit
        on approval; checked against the tool's schema). ``permissions``: what the approver
        holds, for a policy that names an ``approver_permission`` (see
        ``agent.approvals.resolve_interrupt``). ``arguments_version``: the
        ``PendingInterrupt.arguments_version`` the approver saw; an approval of a version
        edited meanwhile raises ``StaleApprovalError`` and changes nothing. ``identity``: who
        decides, compared with who made the call (default: ``approver``); the caller's own
        decision raises ``SelfApprovalError`` unless the policy allows self-approval.
        """
        return approvals.resolve_interrupt(
            self.store, self.app, session_id, interrupt_id, approved,
            rejection_message=rejection_message, approver=approver,
            arguments=arguments, permissions=permissions, arguments_version=arguments_version,
            identity=identity,
        )

    def why_not_resolved(self, session_id: str, interrupt_id: str) -> str | None:
        """Why ``resolve_interrupt(session_id, interrupt_id, ...)`` is refused now, or None if
        the interrupt can still be decided: ``"unknown_interrupt"``, ``"wrong_session"``,
        ``"already_decided"`` (by a person or the deadline sweep) or ``"deadline_passed"``.

        Ask it when ``resolve_interrupt`` returned False; it reads, and changes nothing.
        """
        return session_views.refusal_reason(self.store, session_id, interrupt_id)

    def send_user_message(self, session_id: str, text: str) -> bool:
        """Send a user message into the session's transcript; True once it is stored.

        The message is ``delivered`` at once if no turn of the session is open; otherwise it is
        ``queued`` until every call of the open turn(s) has ended (the snapshot shows which).
        False only for a report of an unknown outcome (a text ending in ``(tool call <key>)``
        that names an ``outcome_unknown`` call of this session) when a user message of the
        session already names that key: each call is reported once, whoever sends it.
        """
        return transcript.send_user_message(self.store, session_id, text) is not None

    def add_assistant_message(self, session_id: str, turn_id: str,
                              text: str) -> hints.SessionMessage:
        """Record the model's own text of turn ``turn_id`` in the session's transcript.

        In a durable turn (:meth:`begin_turn`) this is the model's answer without tools: it
        ends the turn, as :meth:`end_turn` does. The transcript
        (``get_agent_snapshot(...).messages``) then holds the whole conversation: user
        messages, the model's text, and each call's tool message. Returns
        the stored message; :class:`InvalidArgumentError` names a malformed argument.
        """
        return turns.add_assistant_message(self.store, session_id, turn_id, text)

    # -- durable turns (agent/turns.py) ---------------------------------------------------------

    def begin_turn(self, session_id: str, input_text: str, *,
                   turn_id: str | None = None) -> hints.Turn:
        """Begin a durable turn of the session with the user's ``input_text``, or continue the
        one a previous run left open; returns the :class:`Turn`.

        * The session has an open turn with this input: that turn, ``resumed=True``, with its
          journaled ``steps`` (the agent process was restarted: replay them).
        * It has an open turn with another input: the input is queued as a user message (once),
          delivered when that turn ends (the seeds' rule), and the open turn is returned with
          ``queued_input=True``; no second turn is started.
        * ``turn_id`` names a turn that has ended: that turn, with its ``answer``.
        * Otherwise a new turn (``turn_id``, or a fresh id), the input recorded as the user
          message that began it.

        :class:`TurnConflictError` if ``turn_id`` names a turn begun with another input.
        """
        return turns.begin_turn(self.store, session_id, input_text, turn_id)

    def end_turn(self, session_id: str, turn_id: str, text: str, *,
                 response: str | None = None) -> hints.SessionMessage:
        """The model answered without requesting tools: record its answer ``text`` (and its
        serialised ``response``) as an assistant message and end the turn; only then are the
        user messages that waited for it delivered, after the answer in the transcript.

        Idempotent for the same text (a turn that ended with it returns that message); another
        answer for a turn that has ended raises :class:`TurnConflictError`.
        """
        return turns.end_turn(self.store, session_id, turn_id, text, response)

    def open_turn(self, session_id: str) -> hints.Turn | None:
        """The session's open turn with its journaled steps and their calls' records, in one
        read; None when no turn of the session is open."""
        return turns.open_turn(self.store, session_id)

    def events(self, session_id: str, after: int = 0) -> list[hints.CallEvent]:
        """The session's events after cursor ``after`` (an event's ``id``)."""
        return [CallEvent.from_row(r) for r in self.store.events(session_id, after)]


class WaitPauses:
    """How long a waiter for call ``key`` sleeps between reads of the store (unless woken),
    until ``timeout``: ``poll_seconds`` while notifications can arrive, else 5 ms doubling up
    to 200 ms. Shared by both clients' ``wait``, which differ only in how they sleep."""

    def __init__(self, key: str, timeout: float, poll_seconds: float) -> None:
        self.key = key
        self.timeout = timeout
        self.poll_seconds = poll_seconds
        self.deadline = time.monotonic() + timeout
        self.fast = FAST_POLL_FIRST

    def next(self, live: bool) -> float | None:
        """The next pause, or None once time is up."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        if live:
            pause, self.fast = self.poll_seconds, FAST_POLL_FIRST
        else:
            pause, self.fast = self.fast, min(self.fast * 2, FAST_POLL_MAX)
        return min(pause, remaining)

    def timed_out(self, record: hints.ToolCallRecord) -> hints.ToolCallRecord:
        """``record``, read as time ran out, if it ended just then; else ``TimeoutError``
        naming the status it shows (``running`` for an attempt running now)."""
        if record.terminal:
            return record
        raise TimeoutError(f"call {self.key!r} is still {record.status.value} after "
                           f"{self.timeout}s")
