"""The SQL of a move: the guarded UPDATE of each shape, and PostgreSQL's one-statement form.

``transitions.py`` runs the moves; these are what it sends. Each shape of move (its target,
the statuses it may leave, the columns it guards and writes) is built once and bound per call
(:func:`transition_statement`); on PostgreSQL a move that runs on its own is ONE statement
(:func:`single_statement`), its event row and tool message written by data-modifying CTEs.
The rows a move writes besides the status are built from what its UPDATE returned
(:func:`event_row`, :func:`tool_message`), so a move reads nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    Text,
    bindparam,
    cast,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    update,
)

from dex_tasks.states import CallStatus, MessageRole
from dex_tasks.store.connections import store_now
from dex_tasks.store.delivery import DELIVERY_LOCK_RETURNING, DELIVERY_LOCK_SPACE
from dex_tasks.store.records import RECORD_COLUMNS
from dex_tasks.store.sqljson import JsonText, jsonb_text
from dex_tasks.store.tables import CALLS, EVENTS, MESSAGES, event_name

# What a move's UPDATE returns: the event row needs these three; a terminal move also builds
# its call's tool message from the rest (the values just written), so it needs no read.
_RETURNING = (CALLS.c.key, CALLS.c.session_id, CALLS.c.prev_status)
# A terminal move returns the whole ended row: its waiters are handed its record with the
# notification that wakes them (``EndedCall.record``), and need no read of the store.
_RETURNING_TERMINAL = tuple(CALLS.c)


def returning(to: CallStatus) -> tuple[Any, ...]:
    """What the UPDATE of a move to ``to`` returns, for what ``Store._record`` writes."""
    return _RETURNING_TERMINAL if to.terminal else _RETURNING


def returning_one(to: CallStatus, postgres: bool) -> tuple[Any, ...]:
    """:func:`returning` for a single transition, which on PostgreSQL also takes a terminal
    move's delivery lock there (see ``DELIVERY_LOCK_RETURNING``)."""
    columns = returning(to)
    return (*columns, DELIVERY_LOCK_RETURNING) if to.terminal and postgres else columns


# What a claim also guards, besides the call being queued: it has not expired in the queue by
# the claimer's ``:c_now`` (a call expires by the clock of the worker that finds it expired, as
# before a claim existed), and it has an attempt left. In the claim's own WHERE, so a call that
# fails them is never claimed, and nothing has to be undone: the claim returns no row, and
# the worker reads the call to end it "did not run" or as its attempts ran out.
CLAIMABLE = (
    or_(CALLS.c.expires_at.is_(None), CALLS.c.expires_at >= bindparam("c_now")),
    CALLS.c.attempts < CALLS.c.max_attempts,
)


def _guarded_update(to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
                    fields: tuple[str, ...], *, claim: bool = False,
                    json_as_text: bool = False) -> Any:
    """The guarded UPDATE of one transition shape, with every value a bound parameter.

    ``claim``: the move to ``running`` is guarded by :data:`CLAIMABLE` as well, counts the
    attempt and sets the lease on the store's clock (``connections.store_now``) from
    ``:c_lease`` seconds. ``json_as_text`` (PostgreSQL): the values of JSON columns are bound
    as text and cast to jsonb by the server (``sqljson.jsonb_text``)."""
    extra: dict[str, Any] = ({"attempts": CALLS.c.attempts + 1,
                              "lease_expires_at": store_now() + bindparam("c_lease")}
                             if claim else {})
    return (
        update(CALLS)
        # The sources as one bound value each, not an IN list expanded per execution, so the
        # statement compiles once for the driver (``store.driver``).
        .where(CALLS.c.key == bindparam("t_key"),
               CALLS.c.status.in_([literal(s.value, CALLS.c.status.type)
                                   for s in sorted(sources)]),
               *(CALLS.c[k] == bindparam(f"m_{k}") for k in match),
               *(CLAIMABLE if claim else ()))
        # SET evaluates right-hand sides against the old row, so prev_status keeps the status
        # we moved from, for the event row.
        .values(prev_status=CALLS.c.status, status=to.value, **extra,
                **{k: _value(k, json_as_text) for k in fields})
    )


def _value(column: str, json_as_text: bool) -> Any:
    """The parameter ``v_<column>`` of :func:`_guarded_update`."""
    if json_as_text and isinstance(CALLS.c[column].type, JsonText):
        return jsonb_text(f"v_{column}")
    return bindparam(f"v_{column}")


@functools.lru_cache(maxsize=256)
def transition_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...], postgres: bool,
) -> Any:
    """The guarded UPDATE of one transition shape, returning what ``_record`` needs."""
    return _guarded_update(to, sources, match, fields).returning(*returning_one(to, postgres))


# The single-statement form's event detail and time, bound per move. Its JSON (the details,
# and the JSON columns it writes: a result, arguments) is bound as text and cast by the server
# (``sqljson.jsonb_text``): bound as its column type, each value was parsed here, walked and
# written out again by psycopg: about a fifth of the ending's client CPU (its statements in
# ``python -m bench child --store postgres``: 291 against 224 µs a call, the medians of six
# alternating runs, issue 29).
_EV_DETAIL = jsonb_text("ev_detail")
_EV_NOW = bindparam("ev_now", type_=EVENTS.c.created_at.type)
# The start event's, for a move that ends an attempt whose start was not stored.
_ST_DETAIL = jsonb_text("st_detail")
_ST_NOW = bindparam("st_now", type_=EVENTS.c.created_at.type)
# Takes the session's delivery lock and then says whether the session has user messages
# waiting, reading at a snapshot of its own (migration 0008): see ``single_statement``.
SESSION_ENDED_CHECK = "dex_call_ended_check"


@functools.lru_cache(maxsize=256)
def single_statement(
    to: CallStatus, sources: frozenset[CallStatus], match: tuple[str, ...],
    fields: tuple[str, ...], claim: bool = False, started: bool = False,
) -> Any:
    """PostgreSQL: one move as ONE statement, run in autocommit (one round trip, no BEGIN or
    COMMIT): the guarded UPDATE, its event row and, on a move to a terminal status, the call's
    tool message, as data-modifying CTEs that write only what the UPDATE returned.

    A terminal move's RETURNING also calls ``dex_call_ended_check`` (migration 0008), which
    takes the session's delivery lock and then reads whether user messages wait: a VOLATILE
    function reads at a snapshot taken after the lock, so it sees what the lock's previous
    holder committed, as the statements after the UPDATE do in the transaction form. When it
    says yes, the caller delivers them in a transaction of its own (rare; the sweep is the
    backstop). A claim (``claim``) returns the whole row. ``started``: the move ends an
    attempt whose start was not stored (a retrying call, leased in Redis): its
    ``tool_call_started`` event (``:st_detail`` at ``:st_now``) is written first, in the same
    INSERT, and the ending's event says it left ``running``. Its JSON values and event
    details are sent as text the server casts to jsonb (``sqljson.jsonb_text``).
    """
    update_stmt = _guarded_update(to, sources, match, fields, claim=claim, json_as_text=True)
    if claim:
        returned: tuple[Any, ...] = tuple(CALLS.c)
    elif to.terminal:
        returned = (*_RETURNING_TERMINAL, func.dex_call_ended_check(
            literal_column(str(DELIVERY_LOCK_SPACE)), CALLS.c.session_id).label("queued"))
    else:
        returned = _RETURNING
    moved = update_stmt.returning(*returned).cte("moved")
    detail: Any = (func.jsonb_build_object(literal_column("'attempt'"), moved.c.attempts,
                                           literal_column("'worker'"), moved.c.worker)
                   if claim else _EV_DETAIL)
    ended = select(moved.c.session_id, moved.c.key, literal_column(f"'{event_name(to)}'"),
                   literal_column(f"'{CallStatus.RUNNING.value}'") if started
                   else moved.c.prev_status, literal_column(f"'{to.value}'"), detail, _EV_NOW)
    rows: Any = ended
    if started:
        # One INSERT of both rows, the start first, so their ids keep their order.
        rows = select(moved.c.session_id, moved.c.key,
                      literal_column(f"'{event_name(CallStatus.RUNNING)}'"),
                      moved.c.prev_status, literal_column(f"'{CallStatus.RUNNING.value}'"),
                      _ST_DETAIL, _ST_NOW).union_all(ended)
    event = insert(EVENTS).from_select(
        ["session_id", "key", "event", "from_status", "to_status", "detail", "created_at"],
        rows,
    ).cte("moved_event")
    # A terminal move returns what its ending needs besides (``base.note_ended``), and its
    # call's record as JSON text built by the server (:func:`_record_json`).
    stmt = (select(moved.c.session_id, moved.c.tool, moved.c.effect, moved.c.created_at,
                   moved.c.worker, moved.c.queued, _record_json(moved))
            if to.terminal else select(moved)).add_cte(event)
    if to.terminal:
        output = (cast(moved.c.result, Text) if to is CallStatus.SUCCEEDED
                  else moved.c.error)
        message = insert(MESSAGES).from_select(
            ["session_id", "role", "created_at", "turn_id", "tool_call_id", "tool", "key",
             "call_status", "tool_arguments", "tool_output"],
            select(moved.c.session_id, literal_column(f"'{MessageRole.TOOL.value}'"), _EV_NOW,
                   moved.c.turn_id, moved.c.tool_call_id, moved.c.tool, moved.c.key,
                   literal_column(f"'{to.value}'"), moved.c.arguments, output),
        ).cte("moved_message")
        stmt = stmt.add_cte(message)
    return stmt


def _record_json(moved: Any) -> Any:
    """The ended call's record (its :data:`~dex_tasks.store.records.RECORD_COLUMNS`) as one
    JSON text, built by the server from the row its UPDATE returned: signed as it is
    (``ended.ended_message``) and read by a waiter as the record of the whole row was.

    Returned as the whole row (27 columns, each processed, a JSON column read back
    canonicalised) and written out with ``json.dumps``, it cost the ending about 30 µs of
    client CPU a call, a tenth (issue 29). The values
    have the record's shape: a JSON column is its text (jsonb's, which a waiter parses to
    the same value as the canonical text a read gives), a timestamp a number (``float8``'s
    shortest exact text), SQL NULL ``null``."""
    pairs: list[Any] = []
    for name in RECORD_COLUMNS:
        column = moved.c[name]
        pairs += (literal_column(f"'{name}'"),
                  cast(column, Text) if isinstance(CALLS.c[name].type, JsonText) else column)
    return cast(func.json_build_object(*pairs), Text).label("record")


# What ``json.dumps(detail, default=str)`` writes, with its encoder made once: ``json.dumps``
# makes one per call when given an option, and every ending writes one or two details. (An
# encoder keeps no state between calls: one serves every thread.)
_DETAIL = json.JSONEncoder(default=str)


def detail_text(detail: Mapping[str, Any] | None, *, empty: str | None = None) -> str | None:
    """An event's detail as the store holds it: its JSON text, or ``empty`` for no detail
    (None, or an empty mapping)."""
    return _DETAIL.encode(dict(detail)) if detail else empty


def event_row(row: Any, to: CallStatus, detail: Mapping[str, Any] | None,
               now: float, from_status: str | None = None) -> dict[str, Any]:
    """The event row of one move: ``row`` is what its UPDATE returned."""
    return {"session_id": row.session_id, "key": row.key, "event": event_name(to),
            "from_status": from_status or row.prev_status, "to_status": to.value,
            "detail": detail_text(detail),
            "created_at": now}


def tool_message(row: Any, to: CallStatus, now: float) -> dict[str, Any]:
    """The transcript's tool message of a call that just became terminal (``to``)."""
    return {"session_id": row.session_id, "role": MessageRole.TOOL.value, "text": None,
            "status": None, "created_at": now, "delivered_at": None, "turn_id": row.turn_id,
            "tool_call_id": row.tool_call_id, "tool": row.tool, "key": row.key,
            "call_status": to.value, "tool_arguments": row.arguments,
            "tool_output": row.result if to is CallStatus.SUCCEEDED else row.error}
