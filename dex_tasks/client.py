"""DexClient: what an agent process uses to run tool calls and read their records."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

from celery import Celery

from dex_tasks import approvals, catalog, transcript
from dex_tasks.catalog import ToolSpec
from dex_tasks.celery_app import create_app, publish
from dex_tasks.errors import CallNotFoundError, ConflictError, InvalidCallError, UnknownToolError
from dex_tasks.limits import (
    KEY_MAX,
    SESSION_ID_MAX,
    TOOL_CALL_ID_MAX,
    TOOL_NAME_MAX,
    TURN_ID_MAX,
    check_id,
)
from dex_tasks.models import ToolCallRow
from dex_tasks.policy import EffectClass, ToolPolicy, resolve_policy, seconds
from dex_tasks.records import AgentSnapshot, CallEvent, SessionMessage, ToolCallRecord
from dex_tasks.registry import InvalidArguments, canonical_json
from dex_tasks.settings import DexSettings
from dex_tasks.sqljson import same_json
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.store import Store

# Columns a new call's row leaves at their defaults (see _new_row).
_UNSET_COLUMNS: dict[str, Any] = {
    "result": None, "error": None, "finished_at": None, "worker": None,
    "lease_expires_at": None, "prev_status": None, "republishes": 0,
}


__all__ = ["DexClient", "InvalidCallError", "idempotency_key"]


def idempotency_key(session_id: str, turn_id: str, tool_call_id: str) -> str:
    """``session/turn/call``: the call's identity, the same for every attempt.

    Raises :class:`InvalidCallError` naming the field (and the limit) for an id that is empty,
    too long, holds ``/``, a NUL byte or a lone surrogate, and for a key over the limit.
    """
    for field, value, limit in (("session_id", session_id, SESSION_ID_MAX),
                                ("turn_id", turn_id, TURN_ID_MAX),
                                ("tool_call_id", tool_call_id, TOOL_CALL_ID_MAX)):
        check_id(field, value, limit, slash=False, error=InvalidCallError)
    key = f"{session_id}/{turn_id}/{tool_call_id}"
    if len(key) > KEY_MAX:
        raise InvalidCallError(
            f"the idempotency key session_id/turn_id/tool_call_id must be at most {KEY_MAX} "
            f"characters, got {len(key)}: shorten the ids"
        )
    return key


class DexClient:
    """Runs tool calls through Celery and reads their records from the store."""

    def __init__(self, settings: DexSettings | None = None, *, create_tables: bool = True) -> None:
        self.settings = settings or DexSettings()
        # An agent process idles between turns, and the server (or a proxy) may close its
        # pooled connections meanwhile: one that sat idle a second is tested before use. The
        # ping's round trip is nothing next to a second of idling, and none is made under load.
        self.store = Store(self.settings.database_url,
                           retry_seconds=self.settings.store_retry_seconds, ping_after_idle=1.0)
        if create_tables:
            try:
                self.store.create_all()
            except BaseException:
                # A schema of another release (SchemaOutOfDateError): no connection left open.
                self.store.close()
                raise
        self._app: Celery | None = None
        self._catalog_cache: dict[str, tuple[float, catalog.ToolInfo]] = {}

    @classmethod
    def from_env(cls) -> DexClient:
        """A client configured from the ``DEX_*`` environment variables."""
        return cls(DexSettings())

    @property
    def app(self) -> Celery:
        """The Celery app used to publish (created on first use)."""
        if self._app is None:
            self._app = create_app(self.settings, publisher=True)
        return self._app

    def close(self) -> None:
        """Release broker and database connections."""
        if self._app is not None:
            self._app.close()
        self.store.close()

    def __enter__(self) -> DexClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------------

    def call_tool(
        self,
        *,
        session_id: str,
        turn_id: str,
        tool_call_id: str,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        default_effect: EffectClass | str | None = None,
        approval_deadline: float | timedelta | None = None,
        expires_in: float | timedelta | None = None,
    ) -> ToolCallRecord:
        """Record a tool call and start it (or hold it for approval); returns its record.

        Calling again with the same ids returns the same record without running anything; the
        same ids with another tool or other arguments raise :class:`ConflictError`.
        ``default_effect`` is the session's default, used when the tool has neither a policy
        nor MCP hints. ``approval_deadline`` overrides the policy's (seconds from now);
        ``expires_in`` bounds how long the call may wait in the queue before it fails as
        "did not run".
        """
        key = idempotency_key(session_id, turn_id, tool_call_id)
        check_id("tool", tool, TOOL_NAME_MAX, error=InvalidCallError)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise InvalidCallError(
                f"arguments must be a JSON object, got {type(arguments).__name__}"
            )
        try:
            args_json = canonical_json(dict(arguments))
        except ValueError as err:
            raise InvalidCallError(str(err)) from None
        try:
            info = self._lookup(tool)
        except UnknownToolError:
            # The tool may be gone since the call was made: a repeat still gets its record.
            existing = self.store.get_call(key)
            if existing is None:
                raise
            return self._same_call(existing, tool, args_json)
        policy = resolve_policy(info.policy, info.hints, default_effect)
        invalid: str | None = None
        if info.local is not None or policy.needs_approval:
            # Checked here when the tool's code is in this process, and against the schema the
            # workers published when a person would otherwise be asked to approve arguments
            # the tool refuses. (Other calls are checked by the worker: the published schema
            # is stricter than the signature's coercions, "5" for an int for instance.)
            try:
                info.validate(dict(arguments))
            except InvalidArguments as err:
                invalid = str(err)
        row, interrupt = self._new_row(
            key, session_id, turn_id, tool_call_id, tool, args_json, policy,
            approval_deadline=seconds(approval_deadline, "approval_deadline"),
            expires_in=seconds(expires_in, "expires_in"),
            hold=policy.needs_approval and invalid is None,
        )
        # Insert first, read only on conflict: a new call costs one write transaction, and a
        # repeated key is told apart by the primary key, not by a read that could race.
        if not self.store.insert_call(row, interrupt):
            existing = self.store.get_call(key)
            assert existing is not None
            return self._same_call(existing, tool, args_json)

        if invalid is not None:
            self.store.transition(key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
                                  values={"error": f"{TOOL_DID_NOT_RUN}: {invalid}"},
                                  detail={"reason": "invalid_arguments"})
            return self.get_tool_call(key)
        # Read-only view of the row just inserted: building a SQLModel table instance costs
        # about half a millisecond, a quarter of the whole call.
        call = cast(ToolCallRow, SimpleNamespace(**_UNSET_COLUMNS, **row))
        if row["status"] == CallStatus.QUEUED.value and not self._publish_new(call):
            return self.get_tool_call(key)
        # The record as inserted: a worker may already have moved it on, which the next read
        # (get_tool_call, wait) shows.
        return ToolCallRecord.from_row(call)

    def list_tools(self, default_effect: EffectClass | str | None = None) -> list[ToolSpec]:
        """Every tool the workers published (and any registered in this process), by name:
        each one's ``name``, ``description`` (its docstring), ``parameters`` (the JSON schema
        of its arguments) and the ``policy`` a call made now would get, given the session's
        ``default_effect``. What framework adapters build their tools from."""
        return catalog.list_specs(self.store, default_effect)

    def refresh_catalog(self) -> None:
        """Forget cached catalog entries: the next call of each tool reads the catalog."""
        self._catalog_cache.clear()

    def _lookup(self, tool: str) -> catalog.ToolInfo:
        """The tool's catalog entry, cached for ``catalog_cache_seconds``.

        Workers publish the catalog when they start, so a policy change reaches callers
        within that many seconds; each call still stores the policy it was made under.
        """
        ttl = self.settings.catalog_cache_seconds
        cached = self._catalog_cache.get(tool)
        now = time.monotonic()
        if cached is not None and now - cached[0] < ttl:
            return cached[1]
        info = catalog.lookup(self.store, tool)
        if info.local is None and ttl > 0:
            self._catalog_cache[tool] = (now, info)
        return info

    def _new_row(
        self, key: str, session_id: str, turn_id: str, tool_call_id: str, tool: str,
        args_json: str, policy: ToolPolicy, *, approval_deadline: float | None,
        expires_in: float | None, hold: bool,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        now = time.time()
        interrupt = None
        interrupt_id = None
        if hold:
            interrupt_id = uuid.uuid4().hex
            deadline = approval_deadline or policy.approval_deadline
            interrupt = {
                "interrupt_id": interrupt_id,
                "key": key,
                "session_id": session_id,
                "deadline_at": now + deadline if deadline else None,
                "created_at": now,
            }
        row = {
            "key": key,
            "session_id": session_id,
            "turn_id": turn_id,
            "tool_call_id": tool_call_id,
            "tool": tool,
            "arguments": args_json,
            "effect": policy.effect.value,
            "requires_approval": policy.needs_approval,
            "max_attempts": policy.attempts(self.settings.default_max_attempts),
            "time_limit": policy.time_limit,
            "status": (CallStatus.AWAITING_APPROVAL if hold else CallStatus.QUEUED).value,
            "attempts": 0,
            "interrupt_id": interrupt_id,
            # Set before the publish so the republisher leaves a call being published alone.
            "published_at": None if hold else now,
            "expires_at": now + expires_in if expires_in else None,
            "created_at": now,
            "updated_at": now,
        }
        return row, interrupt

    def _publish_new(self, call: ToolCallRow) -> bool:
        """Publish a new call; on failure end it "did not run" and return False."""
        try:
            publish(self.app, call)
            return True
        except Exception as err:  # noqa: BLE001 - any publish failure means no worker got it
            # If the message did get through after all, the worker's claim and this
            # compare-and-set race: exactly one wins, and the record says which.
            self.store.transition(
                call.key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
                values={"error": f"{TOOL_DID_NOT_RUN}: the broker could not be reached "
                                 f"({type(err).__name__}: {err})"},
                detail={"reason": "broker_unreachable"},
            )
            return False

    @staticmethod
    def _same_call(existing: Any, tool: str, args_json: str) -> ToolCallRecord:
        if existing.tool != tool:
            raise ConflictError(existing.key, "tool")
        # By value: PostgreSQL's jsonb hands back its own spelling of the stored arguments.
        if not same_json(existing.arguments, args_json):
            raise ConflictError(existing.key, "arguments")
        return ToolCallRecord.from_row(existing)

    def get_tool_call(self, key: str) -> ToolCallRecord:
        """The call's record; :class:`CallNotFoundError` if no call has that key."""
        row = self.store.get_call(key)
        if row is None:
            raise CallNotFoundError(key)
        return ToolCallRecord.from_row(row)

    def wait(self, key: str, timeout: float = 30.0) -> ToolCallRecord:
        """Block until the call is terminal and return it; ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            record = self.get_tool_call(key)
            if record.terminal:
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"call {key!r} is still {record.status.value} after {timeout}s"
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.2)

    def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
        """The session as one consistent read: ``.tool_calls``, ``.messages`` (the transcript:
        user, assistant and tool messages, oldest first), ``.pending_interrupts`` (approvals
        waiting, deadline not passed) and ``.decided`` (who decided each past approval, when,
        and why)."""
        return approvals.session_snapshot(self.store, session_id)

    # -- approvals and messages -----------------------------------------------------------------

    def resolve_interrupt(
        self,
        session_id: str,
        interrupt_id: str,
        approved: bool,
        rejection_message: str | None = None,
        approver: str | None = None,
    ) -> bool:
        """Approve or reject a pending call; True if this call decided, False otherwise.

        The first decision wins; a later one, one after the deadline, or one for an unknown
        interrupt or another session returns False and changes nothing (safe to retry).
        Approving runs the call; rejecting ends it ``rejected`` with ``rejection_message`` in
        its error, where the model reads it.
        """
        return approvals.resolve_interrupt(
            self.store, self.app, session_id, interrupt_id, approved,
            rejection_message=rejection_message, approver=approver,
        )

    def send_user_message(self, session_id: str, text: str) -> bool:
        """Send a user message into the session's transcript; True once it is stored.

        The message is ``delivered`` at once if no turn of the session is open; otherwise it is
        ``queued`` until every call of the open turn(s) has ended (the snapshot shows which).
        False only for a report of an unknown outcome (a text ending in ``(tool call <key>)``
        that names an ``outcome_unknown`` call of this session) when a user message of the
        session already names that key: each call is reported once, whoever sends it.
        """
        return transcript.send_user_message(self.store, session_id, text) is not None

    def add_assistant_message(self, session_id: str, turn_id: str, text: str) -> SessionMessage:
        """Record the model's own text of turn ``turn_id`` in the session's transcript.

        The transcript (``get_agent_snapshot(...).messages``) then holds the whole
        conversation: user messages, the model's text, and each call's tool message. Returns
        the stored message; :class:`InvalidArgumentError` names a malformed argument.
        """
        return transcript.add_assistant_message(self.store, session_id, turn_id, text)

    def events(self, session_id: str, after: int = 0) -> list[CallEvent]:
        """The session's events after cursor ``after`` (an event's ``id``)."""
        return [CallEvent.from_row(r) for r in self.store.events(session_id, after)]


