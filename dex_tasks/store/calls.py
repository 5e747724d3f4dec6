"""New calls, and the reads of calls, events and the catalog.

A new call is inserted with its first event (and its interrupt) in one transaction; reads are
retried across a lost connection like the writes (a read is always safe to run again).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    bindparam,
    exists,
    false,
    func,
    insert,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from dex_tasks.errors import PrunedCallError
from dex_tasks.policy import EffectClass
from dex_tasks.states import CallStatus
from dex_tasks.store import driver, webhooks
from dex_tasks.store.base import StoreBase
from dex_tasks.store.models import CallEventRow, CatalogRow, ToolCallRow, stored_call
from dex_tasks.store.sqljson import jsonb_text
from dex_tasks.store.tables import (
    CALLS,
    CATALOG,
    EVENTS,
    INSERT_CALL,
    INSERT_EVENT,
    INSERT_INTERRUPT,
    PRUNED_EVENT,
    pruned_keys,
)

_GET_CALL = select(CALLS).where(CALLS.c.key == bindparam("get_key"))


def _read_call(conn: Connection, key: str) -> dict[str, Any] | None:
    """The columns of call ``key``, or None: on SQLite prepared on the DB-API connection
    (``driver.py``: a worker reads each call before its attempt, a waiter on each wake-up)."""
    rows = driver.run(conn, _GET_CALL, {"get_key": key})
    return rows[0]._asdict() if rows else None  # (a new dict: the row's ``_mapping``)


# The tombstone of one key (see ``_refuse_pruned``), a statement built once.
_PRUNED_KEY = select(EVENTS.c.key).where(EVENTS.c.key == bindparam("pruned_key"),
                                         EVENTS.c.event == PRUNED_EVENT)



@functools.lru_cache(maxsize=32)
def _insert_statement(columns: tuple[str, ...], *, check_pruned: bool) -> Any:
    """PostgreSQL: a new call, its first event and (for a single-attempt call) the check of
    its key's tombstone as ONE statement: ``INSERT ... SELECT ... WHERE NOT EXISTS
    (tombstone) ON CONFLICT (key) DO NOTHING RETURNING``, the event inserted from what that
    returned. Returns ``inserted`` (0 when the key exists or is a pruned one's) and
    ``pruned``."""
    tombstone = (exists().where(EVENTS.c.key == bindparam("i_key"),
                                EVENTS.c.event == PRUNED_EVENT)
                 if check_pruned else None)
    values = select(*(_bound(c) for c in columns))
    if tombstone is not None:
        values = values.where(~tombstone)
    new = (pg_insert(CALLS).from_select(list(columns), values)
           .on_conflict_do_nothing(index_elements=[CALLS.c.key])
           .returning(CALLS.c.key, CALLS.c.session_id, CALLS.c.status, CALLS.c.created_at)
           .cte("new_call"))
    event = insert(EVENTS).from_select(
        ["session_id", "key", "event", "from_status", "to_status", "detail", "created_at"],
        select(new.c.session_id, new.c.key, literal_column("'tool_call_requested'"), null(),
               new.c.status, jsonb_text("ev_detail", checked=True),
               new.c.created_at),
    ).cte("new_event")
    count = select(func.count()).select_from(new).scalar_subquery()
    pruned = tombstone if tombstone is not None else false()
    return select(count.label("inserted"), pruned.label("pruned")).add_cte(event)


# The JSON texts of a new call that reach its insert already canonical and checked: its
# arguments (``registry.canonical_json``, which refuses what jsonb cannot hold), and its first
# event's detail (``requested_event``, of the request's options; cast where the statement
# binds it). They are bound as text and cast by the server, which parses them: their column
# type would parse each one here and have psycopg write it out again, about a fifth of the
# insert's client CPU (163 against 130 µs a call, issue 29). Being checked, they skip the
# backstop of ``sqljson.storable_json``.
_CANONICAL_JSON = frozenset({"arguments"})


def _bound(column: str) -> Any:
    """The parameter of ``column`` in :func:`_insert_statement` (``i_<column>``)."""
    if column in _CANONICAL_JSON:
        return jsonb_text(f"i_{column}", checked=True)
    return bindparam(f"i_{column}", type_=CALLS.c[column].type)


UNSENT_GRACE_SECONDS = 2.0
"""A queued call with no ``published_at`` was recorded but not (yet) sent: its recorder
publishes right after the commit and then sets the time. One still without it this many
seconds after it was recorded lost its recorder in between (killed, OOM): the next request
of its key and the republisher send it. Younger ones are left to their recorder, so that
concurrent repeats of a request do not each send a copy."""


def unsent(calls: Iterable[Any], now: float) -> list[Any]:
    """The calls among ``calls`` that were recorded but never sent (see
    :data:`UNSENT_GRACE_SECONDS`)."""
    return [call for call in calls
            if call.status == CallStatus.QUEUED.value and call.published_at is None
            and now - call.created_at >= UNSENT_GRACE_SECONDS]


# json.dumps(..., sort_keys=True), its encoder made once (json.dumps makes one per call when
# given an option); it keeps no state between calls.
_DETAIL = json.JSONEncoder(sort_keys=True)


def requested_event(row: Mapping[str, Any],
                     requested: Mapping[str, Any] | None) -> dict[str, Any]:
    """The first event of a new call; its detail keeps the request's options."""
    return {"session_id": row["session_id"], "key": row["key"], "event": "tool_call_requested",
            "from_status": None, "to_status": row["status"],
            "detail": _DETAIL.encode({"request": dict(requested)})
            if requested is not None else None,
            "created_at": row["created_at"]}



def _refuse_pruned(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """:class:`PrunedCallError` if a new single-attempt call's key is a pruned one's that ran
    (its tombstone, ``tables.PRUNED_EVENT``): it would run again. Retrying calls (reads and
    idempotent writes) may run again, and are not looked up."""
    keys = [r["key"] for r in rows if not EffectClass(r["effect"]).retrying]
    if keys:
        pruned = conn.execute(pruned_keys(keys)).scalars().first()
        if pruned is not None:
            raise PrunedCallError(pruned)


class Calls(StoreBase):
    """Inserts and reads of :class:`~dex_tasks.store.Store`."""

    def insert_call(
        self, row: Mapping[str, Any], interrupt: Mapping[str, Any] | None = None, *,
        requested: Mapping[str, Any] | None = None,
    ) -> bool:
        """Insert a new call (and its interrupt) with its first event; False if the key exists.

        ``requested``: the request's options, kept as that event's detail (a repeat of the
        request is compared with them, see :meth:`requested_options`). Retried across a lost
        connection; when a retry finds the key taken by the very row this call inserted (an
        earlier try committed), that is an insert, not an existing call.
        """
        if interrupt is None and self.is_postgres:
            return self._insert_single(row, requested)
        tries = 0

        def attempt(conn: Connection, n: int) -> None:
            nonlocal tries
            tries = n
            # One call's statements are prepared on SQLite's DB-API connection (store.driver)
            if (not EffectClass(row["effect"]).retrying
                    and driver.run(conn, _PRUNED_KEY, {"pruned_key": row["key"]})):
                raise PrunedCallError(row["key"])
            driver.run(conn, INSERT_CALL, row)
            if interrupt is not None:
                conn.execute(INSERT_INTERRUPT, dict(interrupt))
                webhooks.announce(conn, self, webhooks.AWAITING, [(row, interrupt)])
            driver.run(conn, INSERT_EVENT, requested_event(row, requested))

        try:
            # Its statements go to SQLite's driver, and so can its transaction.
            self._retrying(attempt, on_driver=True)
        except IntegrityError:
            if tries > 1:
                stored = self.get_call(row["key"])
                return stored is not None and (stored.created_at, stored.arguments) == (
                    row["created_at"], row["arguments"])
            return False
        return True

    def _insert_single(self, row: Mapping[str, Any],
                       requested: Mapping[str, Any] | None) -> bool:
        """PostgreSQL's :meth:`insert_call` of a call with no interrupt: the insert, its first
        event and the tombstone check as one statement in autocommit (see
        :func:`_insert_statement`). A retry after a lost reply finds the key taken; the row is
        this call's own when it holds what this call inserted (an earlier try committed)."""
        retrying = EffectClass(row["effect"]).retrying
        stmt = _insert_statement(tuple(sorted(row)), check_pruned=not retrying)
        params = {f"i_{column}": value for column, value in row.items()}
        params["ev_detail"] = requested_event(row, requested)["detail"]
        inserted, tries = False, 0

        def attempt(conn: Connection, n: int) -> None:
            nonlocal inserted, tries
            tries = n
            (result,) = driver.run(conn, stmt, params)  # one row, whatever happened
            if result.pruned:
                raise PrunedCallError(row["key"])
            inserted = bool(result.inserted)

        try:
            self._retrying(attempt, single=True)
        except IntegrityError:
            inserted = False  # another unique value taken: as the transaction form answers
        if inserted:
            return True
        if tries > 1:
            stored = self.get_call(row["key"])
            return stored is not None and (stored.created_at, stored.arguments) == (
                row["created_at"], row["arguments"])
        return False

    def insert_calls(
        self,
        rows: Sequence[Mapping[str, Any]],
        interrupts: Sequence[Mapping[str, Any]] = (),
        *,
        requested: Mapping[str, Any] | None = None,
        then: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Insert several new calls (and their interrupts) with their first events in ONE
        transaction; False, with nothing written, if any of the keys exists already.

        ``then(conn)`` runs in the same transaction after the inserts (the client ends calls
        with invalid arguments there, and journals the model response that requested them),
        so the whole batch commits or none of it does; it runs even when ``rows`` is empty. Retried
        across a lost connection like :meth:`insert_call`: when a retry finds the first key
        taken by the very row this batch inserted, an earlier try committed the whole batch.
        """
        if not rows and then is None:
            return True
        tries = 0

        def attempt(conn: Connection, n: int) -> None:
            nonlocal tries
            tries = n
            if rows:
                _refuse_pruned(conn, rows)
                conn.execute(INSERT_CALL, [dict(r) for r in rows])
                if interrupts:
                    conn.execute(INSERT_INTERRUPT, [dict(i) for i in interrupts])
                    by_key = {r["key"]: r for r in rows}
                    webhooks.announce(conn, self, webhooks.AWAITING,
                                      [(by_key[i["key"]], i) for i in interrupts])
                conn.execute(INSERT_EVENT, [requested_event(r, requested) for r in rows])
            if then is not None:
                then(conn)

        try:
            self._retrying(attempt)
        except IntegrityError:
            # A key taken, or what ``then`` inserts (a journaled step) taken: the caller reads
            # again and finds the other writer's.
            if tries > 1 and rows:
                first = rows[0]
                stored = self.get_call(first["key"])
                return stored is not None and (stored.created_at, stored.arguments) == (
                    first["created_at"], first["arguments"])
            return False
        return True

    def requested_options(self, keys: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """The request options each call was recorded with (its first event's detail), by key;
        None for a call recorded before options were kept."""
        if not keys:
            return {}
        rows = self._fetch(
            select(EVENTS.c.key, EVENTS.c.detail)
            .where(EVENTS.c.key.in_(list(keys)), EVENTS.c.event == "tool_call_requested"))
        found: dict[str, dict[str, Any] | None] = {}
        for row in rows:
            loaded = json.loads(row["detail"]) if row["detail"] else None
            found[row["key"]] = loaded.get("request") if isinstance(loaded, dict) else None
        return found

    def get_calls(self, keys: Sequence[str]) -> dict[str, ToolCallRow]:
        """The stored calls among ``keys`` (one read), by key; missing keys are left out."""
        if not keys:
            return {}
        rows = self._fetch(select(CALLS).where(CALLS.c.key.in_(list(keys))))
        return {r["key"]: stored_call(r) for r in rows}

    def get_call(self, key: str) -> ToolCallRow | None:
        """The stored call, or None. Retried across a lost connection."""
        row = self._retrying(lambda conn, _: _read_call(conn, key), read=True, single=True,
                             prepared=True)
        return stored_call(row) if row else None

    def get_call_columns(self, key: str) -> Mapping[str, Any] | None:
        """The stored call's columns as read, or None: ``get_call`` without building a
        ``ToolCallRow`` (what a poll or a waiter's read needs; see
        ``ToolCallRecord.from_mapping``). Retried across a lost connection."""
        return self._retrying(lambda conn, _: _read_call(conn, key), read=True, single=True,
                              prepared=True)

    def calls_for_session(self, session_id: str) -> list[ToolCallRow]:
        """The session's calls, oldest first."""
        rows = self._fetch(select(CALLS).where(CALLS.c.session_id == session_id)
                           .order_by(CALLS.c.created_at, CALLS.c.key))
        return [stored_call(r) for r in rows]

    def events(self, session_id: str, after: int = 0, limit: int = 1000) -> list[CallEventRow]:
        """The session's events with ``id > after``, in order."""
        rows = self._fetch(select(EVENTS)
                           .where(EVENTS.c.session_id == session_id, EVENTS.c.id > after)
                           .order_by(EVENTS.c.id).limit(limit))
        return [CallEventRow.model_validate(r) for r in rows]

    def events_for_call(self, key: str) -> list[CallEventRow]:
        """Every event of one call, in order."""
        rows = self._fetch(select(EVENTS).where(EVENTS.c.key == key).order_by(EVENTS.c.id))
        return [CallEventRow.model_validate(r) for r in rows]

    # -- catalog --------------------------------------------------------------------------------

    def publish_catalog(self, entries: Iterable[Mapping[str, Any]]) -> int:
        """Upsert catalog entries (one per tool); returns how many were written."""
        count = 0
        with self.write() as conn:
            for entry in entries:
                done = conn.execute(
                    update(CATALOG).where(CATALOG.c.name == entry["name"]).values(**entry)
                ).rowcount
                if not done:
                    conn.execute(insert(CATALOG).values(**entry))
                count += 1
        return count

    def list_catalog(self) -> list[CatalogRow]:
        """Every published catalog entry, by name."""
        return [CatalogRow.model_validate(r)
                for r in self._fetch(select(CATALOG).order_by(CATALOG.c.name))]

    def get_catalog(self, name: str) -> CatalogRow | None:
        """The published catalog entry of one tool."""
        rows = self._fetch(select(CATALOG).where(CATALOG.c.name == name))
        return CatalogRow.model_validate(rows[0]) if rows else None
