"""DexClient: what an agent process uses to run tool calls and read their records.

This module holds the call path: recording calls (one, a turn's batch, a journaled step),
sending them, the catalog lookups they need. What the client does with a session besides
(reads, waits, approvals, messages, turns) is its base class's, in ``session_methods.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from dex_tasks.agent import hints
from dex_tasks.agent.calls import (
    NewCall,
    ToolCallRequest,
    check_tool_name,
    checked_arguments,
    idempotency_key,
    new_call,
    normalized_json,
    request_options,
    same_call,
)
from dex_tasks.agent.session_methods import SessionMethods
from dex_tasks.errors import (
    InvalidCallError,
    StoreUnavailableError,
    UnknownToolError,
)
from dex_tasks.lazy import Deferred
from dex_tasks.limits import APPROVER_MAX, check_id
from dex_tasks.policy import EffectClass, seconds
from dex_tasks.states import TOOL_DID_NOT_RUN, CallStatus
from dex_tasks.tracing import traced_request

# Celery, SQLAlchemy and pydantic-settings are imported when the first client is built, not
# with this module: ``from dex_tasks import DexClient`` stays cheap (dex_tasks.lazy says how).
if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.engine import Connection

    from dex_tasks.agent import turns
    from dex_tasks.broker import announce, webhooks
    from dex_tasks.broker.celery_app import create_app, publish, publish_many
    from dex_tasks.broker.preflight import refuse_if_refused
    from dex_tasks.broker.redis_clients import connector
    from dex_tasks.settings import DexSettings
    from dex_tasks.store import Store, catalog, journal
    from dex_tasks.store.calls import unsent
    from dex_tasks.store.catalog import ToolSpec
    from dex_tasks.store.checkpoints import Checkpoints
    from dex_tasks.store.models import ToolCallRow
    from dex_tasks.store.records import ToolCallRecord
else:
    _deferred = Deferred(globals())
    turns = _deferred("dex_tasks.agent", "turns")
    announce, webhooks = _deferred("dex_tasks.broker", "announce", "webhooks")
    create_app, publish, publish_many = _deferred("dex_tasks.broker.celery_app", "create_app",
                                                  "publish", "publish_many")
    connector = _deferred("dex_tasks.broker.redis_clients", "connector")
    refuse_if_refused = _deferred("dex_tasks.broker.preflight", "refuse_if_refused")
    DexSettings = _deferred("dex_tasks.settings", "DexSettings")
    Store, catalog, journal = _deferred("dex_tasks.store", "Store", "catalog", "journal")
    unsent = _deferred("dex_tasks.store.calls", "unsent")
    ToolSpec = _deferred("dex_tasks.store.catalog", "ToolSpec")
    Checkpoints = _deferred("dex_tasks.store.checkpoints", "Checkpoints")
    ToolCallRow = _deferred("dex_tasks.store.models", "ToolCallRow")
    ToolCallRecord = _deferred("dex_tasks.store.records", "ToolCallRecord")

# Columns a new call's row leaves at their defaults (see calls.new_call).
_UNSET_COLUMNS: dict[str, Any] = {
    "result": None, "error": None, "finished_at": None, "worker": None,
    "lease_expires_at": None, "prev_status": None, "republishes": 0,
    "original_arguments": None,
}

# call_tools: how often a batch is tried again when a concurrent request inserted one of its
# keys between the read and the insert (the second try sees that call and returns it).
_INSERT_TRIES = 3


__all__ = ["DexClient", "InvalidCallError", "ToolCallRequest", "idempotency_key"]


class DexClient(SessionMethods):
    """Runs tool calls through Celery and reads their records from the store.

    The session's reads, waits, approvals, messages and durable turns are inherited from
    :class:`~dex_tasks.agent.session_methods.SessionMethods`."""

    def __init__(self, settings: hints.DexSettings | None = None, *,
                 create_tables: bool = True) -> None:
        self.settings = settings or DexSettings()
        # An agent process idles between turns, and the server (or a proxy) may close its
        # pooled connections meanwhile: one that sat idle a second is tested before use. The
        # ping's round trip is nothing next to a second of idling, and none is made under load.
        self.store = Store(self.settings.database_url,
                           retry_seconds=self.settings.store_retry_seconds, ping_after_idle=1.0,
                           pooler=self.settings.store_pooler == "transaction")
        try:
            # A Redis that refuses the password or a command is a mistake to hear of now, in
            # one line (BrokerRefusedError), not as every call ending "did not run"; one that
            # is down is not waited for.
            refuse_if_refused(self.settings, "client",
                              timeout=self.settings.publish_timeout_seconds)
            if create_tables:
                self.store.create_all()
        except BaseException:
            # A schema of another release (SchemaOutOfDateError), a refusal: no connection
            # left open.
            self.store.close()
            raise
        # Calls this client ends (a rejection, invalid arguments, a failed publish) wake their
        # waiters and are counted like the ones workers end.
        self._notifier = announce.install(
            self.store, self.settings.redis_url, connector(self.settings),
            claim_ended_ttl=self.settings.claim_ended_ttl_seconds)
        webhooks.install(self.store, self.settings, lambda: self.app)
        self._app: Celery | None = None
        self._catalog_cache: dict[str, tuple[float, catalog.ToolInfo]] = {}

    @classmethod
    def from_env(cls) -> DexClient:
        """A client configured from the ``DEX_*`` environment variables."""
        return cls(DexSettings())

    @property
    def app(self) -> hints.Celery:
        """The Celery app used to publish (created on first use)."""
        if self._app is None:
            self._app = create_app(self.settings, publisher=True)
        return self._app

    @property
    def checkpoints(self) -> hints.Checkpoints:
        """LangGraph checkpoints kept in this client's store (what ``DexCheckpointer`` uses)."""
        return Checkpoints(self.store)

    def close(self) -> None:
        """Release broker, Redis and database connections."""
        self._stop_watching()
        if self._app is not None:
            self._app.close()
        self._notifier.close()
        self.store.close()

    def __enter__(self) -> DexClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------------

    @traced_request
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
        requested_by: str | None = None,
    ) -> hints.ToolCallRecord:
        """Record a tool call and start it (or hold it for approval); returns its record.

        Calling again with the same ids returns the same record without running anything; the
        same ids with another tool or other arguments raise :class:`ConflictError`.
        ``default_effect`` is the session's default, used when the tool has neither a policy
        nor MCP hints. ``approval_deadline`` overrides the policy's (seconds from now);
        ``expires_in`` bounds how long the call may wait in the queue before it fails as
        "did not run". ``requested_by`` names who makes the call (the MCP server passes its
        client's token identity): that identity cannot decide the call's approval unless the
        tool's policy has ``allow_self_approval``.
        """
        key = idempotency_key(session_id, turn_id, tool_call_id)
        if requested_by is not None:
            check_id("requested_by", requested_by, APPROVER_MAX)
        check_tool_name(tool)
        plain, args_json = checked_arguments(arguments)
        deadline = seconds(approval_deadline, "approval_deadline")
        expires = seconds(expires_in, "expires_in")
        options = request_options(default_effect, deadline, expires)
        try:
            info = self._lookup(tool)
        except UnknownToolError as err:
            # The tool may be gone since the call was made: a repeat still gets its record.
            existing = self.store.get_call(key)
            if existing is None:
                # The caller's mistake (a name, with "did you mean" from the catalog): its
                # traceback ends here, not in the catalog's internals.
                raise err.with_traceback(None) from None
            return self._repeat(existing, tool, args_json, options)
        call = new_call(
            key, session_id, turn_id, tool_call_id, tool, plain, args_json, info,
            default_effect=default_effect, approval_deadline=deadline, expires_in=expires,
            default_max_attempts=self.settings.default_max_attempts, requested_by=requested_by,
        )
        # Before the insert: whether the end of a call recorded now cannot miss the waiter.
        confirmed = self._sending(session_id)
        # Insert first, read only on conflict: a new call costs one write transaction, and a
        # repeated key is told apart by the primary key, not by a read that could race.
        if not self.store.insert_call(call.row, call.interrupt, requested=options):
            existing = self.store.get_call(key)
            assert existing is not None
            return self._repeat(existing, tool, args_json, options, normalized=call.args_json)
        self._sent(key, session_id, confirmed)

        if call.invalid is not None:
            self.store.transition(key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
                                  values={"error": f"{TOOL_DID_NOT_RUN}: {call.invalid}"},
                                  detail={"reason": "invalid_arguments"})
            return self.get_tool_call(key)
        view = _inserted(call)
        if call.sends_message and not self._publish_new([view]):
            return self.get_tool_call(key)
        # The record as inserted: a worker may already have moved it on, which the next read
        # (get_tool_call, wait) shows. Built from the view's own dict of columns, not
        # attribute by attribute.
        return ToolCallRecord.from_mapping(vars(view))

    def call_tools(
        self,
        calls: Sequence[ToolCallRequest | Mapping[str, Any]],
        *,
        session_id: str,
        turn_id: str,
        default_effect: EffectClass | str | None = None,
        approval_deadline: float | timedelta | None = None,
        expires_in: float | timedelta | None = None,
    ) -> list[hints.ToolCallRecord]:
        """Record a turn's parallel tool calls in one transaction and start them with one Redis
        round trip; returns their records in the order given.

        ``calls`` are :class:`ToolCallRequest` items (or dicts with ``tool_call_id``, ``tool``
        and ``arguments``); the other arguments are shared by all of them and mean what they
        mean for :meth:`call_tool`. Each call follows :meth:`call_tool`'s rules: a repeat (same
        ids, tool and arguments) returns its stored record without running anything, a call
        that needs approval waits for it, invalid arguments end it "did not run".

        All or nothing: every request is checked before anything is written. A malformed
        request (:class:`InvalidCallError` naming ``calls[i]`` and the field), a tool_call_id
        given twice, an unknown tool, or a repeat whose tool or arguments differ from the
        stored call's (:class:`ConflictError`) raises, and then no call of the batch is
        recorded or sent. If the broker cannot be reached, the calls that were to start end
        "did not run" (those a worker received anyway run: the store's compare-and-set
        decides, as for :meth:`call_tool`).
        """
        return self._record_calls(_requests(calls), session_id, turn_id, default_effect,
                                  approval_deadline, expires_in)

    @traced_request
    def _record_calls(
        self, requests: Sequence[ToolCallRequest], session_id: str, turn_id: str,
        default_effect: EffectClass | str | None, approval_deadline: float | timedelta | None,
        expires_in: float | timedelta | None, step: turns.StepJournal | None = None,
    ) -> list[ToolCallRecord]:
        """``call_tools``, and ``record_step`` when ``step`` is given: the step's assistant
        message is then inserted in the calls' transaction, unless it is journaled already
        (with the same response and calls: else :class:`TurnConflictError`)."""
        deadline = seconds(approval_deadline, "approval_deadline")
        expires = seconds(expires_in, "expires_in")
        options = request_options(default_effect, deadline, expires)
        checked: list[tuple[str, ToolCallRequest, dict[str, Any], str]] = []
        seen: dict[str, int] = {}
        for i, request in enumerate(requests):
            try:
                key = idempotency_key(session_id, turn_id, request.tool_call_id)
                check_tool_name(request.tool)
                plain, args_json = checked_arguments(request.arguments)
            except InvalidCallError as err:
                raise InvalidCallError(f"calls[{i}]: {err}") from None
            if key in seen:
                raise InvalidCallError(
                    f"calls[{i}]: tool_call_id {request.tool_call_id!r} is already used by "
                    f"calls[{seen[key]}] of this batch")
            seen[key] = i
            checked.append((key, request, plain, args_json))

        tool_calls = journal.step_calls(
            [{"tool_call_id": request.tool_call_id, "tool": request.tool, "arguments": plain}
             for _, request, plain, _ in checked])
        # A new step's calls are new: its first try inserts without reading (one transaction,
        # as call_tool's does); a key or the step found taken makes it read, as call_tools does.
        guess = step is not None
        # Before the insert: whether the ends of calls recorded now cannot miss their waiters.
        confirmed = self._sending(session_id)
        for _ in range(_INSERT_TRIES + guess):
            write_step = None
            if step is not None:
                stored_step = None if guess else step.stored(self.store)
                if stored_step is not None:
                    step.check_same(stored_step, tool_calls)  # TurnConflictError
                else:
                    write_step = step.writer(tool_calls)
            existing = {} if guess else self.store.get_calls([key for key, *_ in checked])
            stored_options = {} if guess else self.store.requested_options(list(existing))
            guess = False
            new: list[NewCall] = []
            for key, request, plain, args_json in checked:
                if key in existing:
                    same_call(existing[key], request.tool, args_json,  # ConflictError
                              options, stored_options.get(key),
                              normalized=self._normalized(request.tool, plain))
                    continue
                new.append(new_call(
                    key, session_id, turn_id, request.tool_call_id, request.tool, plain,
                    args_json, self._lookup(request.tool),  # UnknownToolError
                    default_effect=default_effect, approval_deadline=deadline,
                    expires_in=expires, default_max_attempts=self.settings.default_max_attempts,
                ))
            if self.store.insert_calls([c.row for c in new],
                                       [c.interrupt for c in new if c.interrupt is not None],
                                       requested=options,
                                       then=self._end_invalid(new, write_step)):
                break
        else:
            raise StoreUnavailableError(
                f"the calls of turn {turn_id!r} kept colliding with concurrent requests for "
                f"the same ids; nothing of this batch was recorded")

        for c in new:
            # (Not the calls with invalid arguments: their ends, in the insert's transaction,
            # were announced before this; their waiters find them ended in the store.)
            if c.invalid is None:
                self._sent(c.key, session_id, confirmed)
        views = {c.key: _inserted(c) for c in new}
        # Calls recorded but never sent (their recorder died before its publish) go with them.
        to_send = [views[c.key] for c in new if c.sends_message]
        to_send += unsent(existing.values(), time.time())
        reread = {c.key for c in new if c.invalid is not None}
        if to_send and not self._publish_new(to_send):
            reread |= {call.key for call in to_send}
        fresh = self.store.get_calls(sorted(reread)) if reread else {}
        records: list[ToolCallRecord] = []
        for key, *_ in checked:
            row = fresh.get(key) or existing.get(key) or views[key]
            records.append(ToolCallRecord.from_row(row))
        return records

    def list_tools(
        self, default_effect: EffectClass | str | None = None,
    ) -> list[hints.ToolSpec]:
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

    def _publish_new(self, calls: Sequence[ToolCallRow]) -> bool:
        """Publish new calls (several in one Redis round trip); on failure end them "did not
        run" (in one transaction) and return False."""
        try:
            if len(calls) == 1:
                publish(self.app, calls[0])
            else:
                publish_many(self.app, calls)
        except Exception as err:  # noqa: BLE001 - any publish failure means no worker got it
            # If a message did get through after all, the worker's claim and this
            # compare-and-set race: exactly one wins, and the record says which.
            error = (f"{TOOL_DID_NOT_RUN}: the broker could not be reached "
                     f"({type(err).__name__}: {err})")
            # call_tool returns within DEX_PUBLISH_TIMEOUT_SECONDS: announcing these ends
            # would wait on the same unreachable Redis again (issue 19, P4).
            self._notifier.hold_off()
            with self.store.write() as conn:
                for call in calls:
                    self.store.transition(
                        call.key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
                        values={"error": error}, detail={"reason": "broker_unreachable"},
                        conn=conn,
                    )
            return False
        # Recorded with no publish time: until this lands, the republisher (after a few
        # seconds) and the next request of the key send a call whose recorder died before
        # its publish. Written off this path for new calls, one UPDATE for many.
        self.store.mark_sent(calls)
        return True

    def _end_invalid(self, calls: Sequence[NewCall],
                     write_step: Callable[[Connection], None] | None = None,
                     ) -> Callable[[Connection], None]:
        """What ``insert_calls`` runs in its transaction: journal the step (``record_step``),
        and end the calls whose arguments were refused "did not run", as ``call_tool`` does
        (there in a transaction of its own)."""

        def end(conn: Connection) -> None:
            if write_step is not None:
                write_step(conn)
            for call in calls:
                if call.invalid is not None:
                    self.store.transition(
                        call.key, CallStatus.FAILED, allowed={CallStatus.QUEUED},
                        values={"error": f"{TOOL_DID_NOT_RUN}: {call.invalid}"},
                        detail={"reason": "invalid_arguments"}, conn=conn,
                    )

        return end

    def _normalized(self, tool: str, arguments: dict[str, Any]) -> str | None:
        """The normalized JSON a repeated request's arguments were recorded as, if the tool is
        still known (``calls.normalized_json``)."""
        try:
            info = self._lookup(tool)
        except UnknownToolError:
            return None
        return normalized_json(info, arguments)

    def _repeat(self, existing: ToolCallRow, tool: str, args_json: str,
                options: dict[str, Any], *, normalized: str | None = None) -> ToolCallRecord:
        """The stored record of a repeated request, or :class:`ConflictError` naming what the
        request changed (the stored options are read only here, on the repeat path)."""
        stored = self.store.requested_options([existing.key]).get(existing.key)
        record = same_call(existing, tool, args_json, options, stored, normalized=normalized)
        if unsent([existing], time.time()) and not self._publish_new([existing]):
            return self.get_tool_call(existing.key)
        return record

    # -- durable turns (agent/turns.py) ---------------------------------------------------------

    def record_step(
        self,
        session_id: str,
        turn_id: str,
        step: int,
        response: str,
        calls: Sequence[ToolCallRequest | Mapping[str, Any]],
        *,
        text: str | None = None,
        default_effect: EffectClass | str | None = None,
        approval_deadline: float | timedelta | None = None,
        expires_in: float | timedelta | None = None,
    ) -> list[hints.ToolCallRecord]:
        """Journal one model response of the turn and start the calls it requested; returns
        their records in the order given.

        ``step`` is the response's position in the turn (0 first; the next one, or one already
        journaled), ``response`` the response as the adapter serialises it (JSON text, given
        back by :meth:`open_turn` to replay), ``text`` the model's text in it, ``calls`` its
        tool calls (as for :meth:`call_tools`, whose other arguments these are). The step is an
        assistant message carrying the calls, written in the same transaction as the calls,
        before any of them is sent. A turn not begun is begun by its first step.

        Idempotent: recording a journaled step again (a replay) returns its calls' records and
        starts nothing again, except a call recorded but never sent, which is sent once. Another
        response or other calls for a journaled step, or a step in a turn that has ended, raise
        :class:`TurnConflictError` naming the step; nothing is written.
        """
        requests = _requests(calls)
        journaled = turns.step_journal(session_id, turn_id, step, response, text)
        return self._record_calls(requests, session_id, turn_id, default_effect,
                                  approval_deadline, expires_in, step=journaled)


def _inserted(call: NewCall) -> ToolCallRow:
    # A read-only view of the row just inserted: building a SQLModel table instance costs about
    # half a millisecond, a quarter of a whole call_tool.
    return cast(ToolCallRow, SimpleNamespace(**_UNSET_COLUMNS, **call.row))


def _requests(calls: Sequence[ToolCallRequest | Mapping[str, Any]]) -> list[ToolCallRequest]:
    """``calls`` as :class:`ToolCallRequest` items; :class:`InvalidCallError` names the first
    malformed one (``calls[i].field``)."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise InvalidCallError(
            f"calls must be a list of tool call requests, got {type(calls).__name__}")
    out: list[ToolCallRequest] = []
    for i, item in enumerate(calls):
        if isinstance(item, ToolCallRequest):
            out.append(item)
            continue
        try:
            out.append(ToolCallRequest.model_validate(item))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidCallError(
                f"calls[{i}]{'.' + where if where else ''}: {first['msg']}") from None
    return out
