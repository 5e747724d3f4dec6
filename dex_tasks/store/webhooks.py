"""The webhook outbox: approval events written in the transaction that made them.

Three events reach people: ``tool_call_awaiting_approval`` (a call starts waiting),
``tool_call_decided`` (approved, rejected, or its deadline passed) and
``approval_deadline_near`` (``DEX_WEBHOOK_DEADLINE_LEAD_SECONDS`` before the deadline). The code
that makes each one (the call's insert, ``resolve_interrupt``, the deadline sweeps) calls
:func:`announce` inside its own transaction: one ``dex_webhooks`` row per event and URL
(``DEX_WEBHOOK_URLS`` plus the tool's own ``webhooks``), with the JSON body fixed there, so
every retry sends the same bytes. Once the transaction has committed the rows are handed to
``store.publish_webhooks`` (a Celery publish, ``broker/webhooks.py``); a publish that fails
leaves the row ``pending``, and the republish sweep sends it later. An event that was not
committed is never sent; one that was is never lost.

The call never waits for a receiver: the row is one insert in a transaction that was being
written anyway, and delivery happens in the workers' main processes, outside the pool that
runs calls (``worker/webhooks.py``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection

from dex_tasks.store.base import StoreBase, after_commit
from dex_tasks.store.tables import CALLS, INTERRUPTS, WEBHOOKS

AWAITING = "tool_call_awaiting_approval"
DECIDED = "tool_call_decided"
DEADLINE_NEAR = "approval_deadline_near"
EVENTS = (AWAITING, DECIDED, DEADLINE_NEAR)

PENDING = "pending"
DELIVERED = "delivered"
FAILED = "failed"

_INSERT = insert(WEBHOOKS)


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC).isoformat()


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def body(event: str, event_id: str, call: Mapping[str, Any], interrupt: Mapping[str, Any],
         approved_by: Sequence[str], public_url: str | None, now: float) -> dict[str, Any]:
    """The JSON body of one event: the call, the interrupt, the page link."""
    page = None
    if public_url:
        page = f"{public_url.rstrip('/')}/sessions/{quote(call['session_id'], safe='')}"
    return {
        "id": event_id,
        "type": event,
        "created_at": _iso(now),
        "call": {
            "key": call["key"], "session_id": call["session_id"], "turn_id": call["turn_id"],
            "tool_call_id": call["tool_call_id"], "tool": call["tool"],
            "arguments": _loads(call["arguments"]),
            "original_arguments": _loads(call.get("original_arguments")),
            "effect": call["effect"], "status": call["status"], "error": call.get("error"),
            "approval_rule": _loads(call.get("approval_rule")),
        },
        "interrupt": {
            "interrupt_id": interrupt["interrupt_id"],
            "deadline": _iso(interrupt.get("deadline_at")),
            "decision": interrupt.get("decision"),
            "decided_by": interrupt.get("decided_by"),
            "reason": interrupt.get("reason"),
            "approvals_required": interrupt.get("approvals_required") or 1,
            "approved_by": list(approved_by),
        },
        "page": page,
    }


def urls_for(store: StoreBase, interrupt: Mapping[str, Any]) -> list[str]:
    """Where an interrupt's events go: ``DEX_WEBHOOK_URLS``, then the tool's own (once each)."""
    own = _loads(interrupt.get("webhook_urls")) or []
    return list(dict.fromkeys([*store.webhook_urls, *own]))


def announce(conn: Connection, store: StoreBase, event: str,
             pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
             now: float | None = None,
             approved_by: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """Write the outbox rows of ``event`` for each (call, interrupt) of ``pairs`` in ``conn``'s
    transaction, and publish them once it has committed; returns the delivery ids."""
    now = time.time() if now is None else now
    rows = []
    for call, interrupt in pairs:
        urls = urls_for(store, interrupt)
        if not urls:
            continue
        event_id = uuid.uuid4().hex
        payload = json.dumps(
            body(event, event_id, call, interrupt,
                 (approved_by or {}).get(interrupt["interrupt_id"], ()), store.public_url, now),
            sort_keys=True, separators=(",", ":"))
        for url in urls:
            rows.append({"delivery_id": uuid.uuid4().hex, "event_id": event_id, "event": event,
                         "session_id": call["session_id"], "key": call["key"], "url": url,
                         "payload": payload, "status": PENDING, "attempts": 0,
                         "last_status": None, "last_error": None, "created_at": now,
                         "updated_at": now, "published_at": now, "delivered_at": None})
    if not rows:
        return []
    conn.execute(_INSERT, rows)
    ids = [r["delivery_id"] for r in rows]
    publish = store.publish_webhooks
    if publish is not None:
        after_commit(conn, lambda: publish(ids))
    return ids


def announce_keys(conn: Connection, store: StoreBase, event: str, keys: Sequence[str],
                  now: float | None = None,
                  approved_by: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """:func:`announce` for calls named by key, read in ``conn`` (after the change that made
    the event, so the body shows it). Reads nothing when no URL is configured anywhere and no
    interrupt names one: it reads the interrupts first, by key."""
    if not keys:
        return []
    interrupts = [dict(r) for r in conn.execute(
        select(INTERRUPTS).where(INTERRUPTS.c.key.in_(list(keys)))).mappings()]
    wanted = [i for i in interrupts if urls_for(store, i)]
    if not wanted:
        return []
    calls = {r["key"]: dict(r) for r in conn.execute(
        select(CALLS).where(CALLS.c.key.in_([i["key"] for i in wanted]))).mappings()}
    return announce(conn, store, event, [(calls[i["key"]], i) for i in wanted
                                         if i["key"] in calls], now, approved_by)


# -- what the delivering worker and the operators read and write ----------------------------------


def get_delivery(store: StoreBase, delivery_id: str) -> dict[str, Any] | None:
    """One delivery row, or None."""
    rows = _fetch(store, select(WEBHOOKS).where(WEBHOOKS.c.delivery_id == delivery_id))
    return rows[0] if rows else None


def record_attempt(store: StoreBase, delivery_id: str, *, ok: bool, final: bool,
                   status_code: int | None, error: str | None,
                   now: float | None = None) -> bool:
    """Count one attempt of a pending delivery: ``delivered`` on success, ``failed`` when it
    was the last, else still ``pending``. True if the row was pending (this attempt counted)."""
    now = time.time() if now is None else now
    status = DELIVERED if ok else (FAILED if final else PENDING)
    with store.write() as conn:
        moved = conn.execute(
            update(WEBHOOKS)
            .where(WEBHOOKS.c.delivery_id == delivery_id, WEBHOOKS.c.status == PENDING)
            .values(status=status, attempts=WEBHOOKS.c.attempts + 1, last_status=status_code,
                    last_error=error, updated_at=now, published_at=now,
                    delivered_at=now if ok else None)
        ).rowcount
    return bool(moved)


def stale_pending(store: StoreBase, older_than: float, limit: int = 500) -> list[str]:
    """Pending deliveries nobody touched since ``older_than`` (a publish lost, a worker gone),
    through the ``(status, published_at)`` index; marked as published now, so two sweeps do
    not both send one."""
    with store.write() as conn:
        ids = list(conn.execute(
            select(WEBHOOKS.c.delivery_id)
            .where(WEBHOOKS.c.status == PENDING, WEBHOOKS.c.published_at < older_than)
            .order_by(WEBHOOKS.c.published_at).limit(limit)).scalars())
        if not ids:
            return []
        now = time.time()
        taken = list(conn.execute(
            update(WEBHOOKS)
            .where(WEBHOOKS.c.delivery_id.in_(ids), WEBHOOKS.c.status == PENDING,
                   WEBHOOKS.c.published_at < older_than)
            .values(published_at=now)
            .returning(WEBHOOKS.c.delivery_id)).scalars())
    return taken


def list_deliveries(store: StoreBase, *, status: str | None = None, event_id: str | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    """Deliveries, newest first (for ``dex-tasks webhooks``)."""
    query = select(WEBHOOKS).order_by(WEBHOOKS.c.created_at.desc()).limit(limit)
    if status is not None:
        query = query.where(WEBHOOKS.c.status == status)
    if event_id is not None:
        query = query.where(WEBHOOKS.c.event_id == event_id)
    return _fetch(store, query)


def _fetch(store: StoreBase, query: Any) -> list[dict[str, Any]]:
    return store.reading(lambda conn: [dict(r) for r in conn.execute(query).mappings()])
