"""A session's event stream as Server-Sent Events.

Each store event becomes one SSE message whose ``id:`` is the event's cursor, ``event:`` its
name (``tool_call_requested``, ``tool_call_started``, ``tool_call_finished`` ...) and ``data:``
the :class:`~dex_tasks.store.records.CallEvent` as JSON. A client that reconnects sends the last
id it saw as ``Last-Event-ID`` (browsers do this by themselves) and the stream resumes after it,
so a dropped connection loses nothing.

The store is the only source: the stream polls it every ``poll_seconds`` (one indexed range read
on ``(session_id, id)``), which works the same with any number of API processes and needs no
broker. A comment line goes out after ``heartbeat_seconds`` of silence so proxies keep the
connection open and a vanished client is noticed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import Request

from dex_tasks.agent.client import DexClient
from dex_tasks.store.records import CallEvent

log = logging.getLogger(__name__)

RECONNECT_MILLISECONDS = 1000
MAX_CURSOR = 2**63 - 1  # event ids are signed 64-bit integers in both stores


def parse_cursor(field: str, value: str | None) -> int:
    """A cursor from ``?after=`` or ``Last-Event-ID`` (None or empty: 0).

    Raises ``ValueError`` naming ``field`` unless it is an integer from 0 to 2^63-1: the store
    cannot compare a larger one, and the check must come before the stream starts (a stream
    that has sent its 200 can only abort).
    """
    if value is None or value == "":
        return 0
    text = value.strip()
    # Digits only (int() would also take "+5", "1_000" and non-ASCII digits), and a bounded
    # length before converting: int() of thousands of digits is refused anyway.
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) > MAX_CURSOR:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(f"{field} must be an integer from 0 to {MAX_CURSOR}, got {shown!r}")
    return int(text)


def format_event(event: CallEvent) -> str:
    """One SSE message for ``event``."""
    # model_dump_json never emits a raw newline, so the data fits on one ``data:`` line.
    return f"id: {event.id}\nevent: {event.event}\ndata: {event.model_dump_json()}\n\n"


class StreamCounter:
    """The open event streams: how many (shown by ``/healthz``), and whether to end them.

    ``closing`` is set when the server starts to shut down: every stream then ends within one
    poll, instead of holding the shutdown until its timeout (browsers reconnect by themselves,
    with ``Last-Event-ID``, to whichever server answers next).
    """

    def __init__(self) -> None:
        self.open = 0
        self.closing = False


async def event_stream(
    request: Request,
    client: DexClient,
    session_id: str,
    after: int,
    *,
    counter: StreamCounter,
    poll_seconds: float,
    heartbeat_seconds: float,
) -> AsyncIterator[str]:
    """Yield the session's events after cursor ``after``, then new ones as they are stored.

    Runs until the client disconnects (Starlette cancels this generator when the connection
    closes, and the loop also checks between polls: an ASGI server may only tell us that way)
    or the server shuts down (``counter.closing``).
    """
    counter.open += 1
    cursor = after
    log.info("event stream opened", extra={"action": "event_stream_opened",
                                           "session_id": session_id, "after": after})
    try:
        # Tell EventSource how soon to reconnect after a drop.
        yield f"retry: {RECONNECT_MILLISECONDS}\n\n"
        quiet_since = time.monotonic()
        while not counter.closing and not await request.is_disconnected():
            # The store is synchronous: read it in a worker thread, never on the event loop.
            batch = await anyio.to_thread.run_sync(client.events, session_id, cursor)
            for event in batch:
                cursor = event.id
                yield format_event(event)
            if batch:
                quiet_since = time.monotonic()
                continue  # a full batch may mean more are waiting: read again at once
            if time.monotonic() - quiet_since >= heartbeat_seconds:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
            await anyio.sleep(poll_seconds)
    finally:
        counter.open -= 1
        log.info("event stream closed", extra={"action": "event_stream_closed",
                                               "session_id": session_id, "cursor": cursor})
