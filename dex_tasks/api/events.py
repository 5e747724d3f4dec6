"""A session's event stream as Server-Sent Events.

Each store event becomes one SSE message whose ``id:`` is the event's cursor, ``event:`` its
name (``tool_call_requested``, ``tool_call_started``, ``tool_call_finished`` ...) and ``data:``
the :class:`~dex_tasks.store.records.CallEvent` as JSON. A client that reconnects sends the last
id it saw as ``Last-Event-ID`` (browsers do this by themselves) and the stream resumes after it,
so a dropped connection loses nothing.

The store is the only source, which works the same with any number of API processes and needs
no broker. An idle stream does not read it: one :class:`StreamHub` per API process reads which
sessions have new events every ``poll_seconds`` (one range read on the events' primary key, for
every stream of the process together) and wakes those sessions' streams, which then read their
own events (one indexed range read on ``(session_id, id)``). Each stream also reads once every
``heartbeat_seconds`` by itself, and a comment line goes out after that long of silence so
proxies keep the connection open and a vanished client is noticed. The framing, the
keep-alive and the disconnect are sse-starlette's (:func:`event_response`).

Limits: at most ``max_streams`` streams per API process and ``max_per_token`` per token
(``DEX_MAX_EVENT_STREAMS``, ``DEX_MAX_EVENT_STREAMS_PER_TOKEN``; a stream past either is refused
with 429 naming it), and a stream ends when its token expires: the browser's reconnection then
gets 401 and the page asks for a new link.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator

import anyio
from sqlalchemy import func, select
from sse_starlette import EventSourceResponse, ServerSentEvent

from dex_tasks.agent.client import DexClient
from dex_tasks.store import EVENTS, Store
from dex_tasks.store.records import CallEvent

log = logging.getLogger(__name__)

RECONNECT_MILLISECONDS = 1000
MAX_CURSOR = 2**63 - 1  # event ids are signed 64-bit integers in both stores


def sse_message(event: CallEvent) -> dict[str, str | int]:
    """One SSE message for ``event``, framed by sse-starlette."""
    # model_dump_json never emits a raw newline, so the data fits on one ``data:`` line.
    return {"id": str(event.id), "event": event.event, "data": event.model_dump_json()}


def event_response(stream: AsyncIterator[dict[str, str | int]], *,
                   heartbeat_seconds: float) -> EventSourceResponse:
    """``stream`` as ``text/event-stream``: sse-starlette frames each message, sends a
    ``: keep-alive`` comment every ``heartbeat_seconds`` (proxies keep the connection open and a
    vanished client is noticed) and ends the stream when the client disconnects."""
    return EventSourceResponse(
        stream, sep="\n", ping=heartbeat_seconds,
        ping_message_factory=lambda: ServerSentEvent(comment="keep-alive", sep="\n"),
        # no-transform / X-Accel-Buffering: proxies must pass each event on at once.
        headers={"Cache-Control": "no-store, no-transform"})


class StreamLimitError(Exception):
    """A new stream would pass one of the limits; the message names it and its setting."""


class StreamSlot:
    """One open stream's place in the counts; given back once (when the stream ends, or when
    its generator is dropped without ever starting)."""

    def __init__(self, hub: StreamHub, token_id: str) -> None:
        self.hub = hub
        self.token_id = token_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.hub._release(self.token_id)

    def __del__(self) -> None:
        self.release()


class StreamHub:
    """The open event streams of one API process: counted (``open``, shown by ``/healthz``),
    capped, woken when their session has new events, and ended at shutdown.

    ``closing`` is set when the server starts to shut down: every stream then ends within a
    fraction of a second, instead of holding the shutdown until its timeout (browsers reconnect
    by themselves, with ``Last-Event-ID``, to whichever server answers next).
    """

    def __init__(self, store: Store, *, poll_seconds: float = 0.25, max_streams: int = 1000,
                 max_per_token: int = 10) -> None:
        self.store = store
        self.poll_seconds = poll_seconds
        self.max_streams = max_streams
        self.max_per_token = max_per_token
        self.open = 0
        self.closing = False
        self.reads = 0  # the hub's own store reads, for tests and benchmarks
        self._per_token: dict[str, int] = {}
        self._waiters: dict[str, set[anyio.Event]] = {}
        self._last_id: int | None = None
        self._polling = False
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def reserve(self, token: str) -> StreamSlot:
        """A slot for a new stream of ``token``, or :class:`StreamLimitError`."""
        token_id = hashlib.sha256(token.encode()).hexdigest()
        if self.open >= self.max_streams:
            raise StreamLimitError(
                f"too many event streams open on this server: at most {self.max_streams} "
                "(DEX_MAX_EVENT_STREAMS); try again later")
        if self._per_token.get(token_id, 0) >= self.max_per_token:
            raise StreamLimitError(
                f"too many event streams open with this token: at most {self.max_per_token} "
                "(DEX_MAX_EVENT_STREAMS_PER_TOKEN); close one first")
        self.open += 1
        self._per_token[token_id] = self._per_token.get(token_id, 0) + 1
        return StreamSlot(self, token_id)

    def _release(self, token_id: str) -> None:
        self.open -= 1
        left = self._per_token.get(token_id, 1) - 1
        if left > 0:
            self._per_token[token_id] = left
        else:
            self._per_token.pop(token_id, None)

    def shut_down(self) -> None:
        """End every stream now (the server is stopping)."""
        self.closing = True
        for waiters in list(self._waiters.values()):
            for waiter in list(waiters):
                waiter.set()

    async def wait(self, session_id: str, waiter: anyio.Event, timeout: float) -> None:
        """Until ``waiter`` is set (the session has new events, or the server stops) or
        ``timeout`` passes. ``waiter`` is registered by :meth:`waiter` before the stream's
        store read, so events stored between that read and this wait still wake it."""
        try:
            if not self._polling:
                self._polling = True
                # Kept: the loop holds only a weak reference to a task.
                self._task = asyncio.get_running_loop().create_task(self._poll())
            with anyio.move_on_after(timeout):
                await waiter.wait()
        finally:
            waiters = self._waiters.get(session_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[session_id]

    def waiter(self, session_id: str) -> anyio.Event:
        """A wake-up for the stream of ``session_id``, set when it has new events."""
        waiter = anyio.Event()
        self._waiters.setdefault(session_id, set()).add(waiter)
        return waiter

    async def _poll(self) -> None:
        """While any stream waits: which sessions have new events, every ``poll_seconds``."""
        try:
            while self._waiters and not self.closing:
                try:
                    sessions = await anyio.to_thread.run_sync(self._new_sessions)
                except Exception as err:  # noqa: BLE001 - streams read by themselves meanwhile
                    if not self._failing:
                        self._failing = True
                        log.warning("event hub cannot read the store; streams fall back to "
                                    "reading it every heartbeat",
                                    extra={"action": "event_hub_failed",
                                           "error": f"{type(err).__name__}: {err}"})
                    sessions = []
                else:
                    self._failing = False
                for session_id in sessions:
                    for waiter in self._waiters.get(session_id, ()):
                        waiter.set()
                await anyio.sleep(self.poll_seconds)
        finally:
            self._polling = False

    def _new_sessions(self) -> list[str]:
        """The sessions with events after the last id seen (none on the first read)."""
        self.reads += 1
        last = self._last_id
        if last is None:
            top = self.store.reading(
                lambda conn: conn.execute(select(func.max(EVENTS.c.id))).scalar())
            self._last_id = int(top or 0)
            return []
        rows = self.store.reading(lambda conn: [tuple(r) for r in conn.execute(
            select(EVENTS.c.session_id, func.max(EVENTS.c.id))
            .where(EVENTS.c.id > last).group_by(EVENTS.c.session_id))])
        if rows:
            self._last_id = max(int(top) for _, top in rows)
        return [str(session_id) for session_id, _ in rows]


def latest_event_id(store: Store, session_id: str) -> int:
    """The session's latest event id (0 if none): a stream opened after it misses nothing
    that happened since."""
    top = store.reading(lambda conn: conn.execute(
        select(func.max(EVENTS.c.id)).where(EVENTS.c.session_id == session_id)).scalar())
    return int(top or 0)


async def event_stream(
    client: DexClient,
    session_id: str,
    after: int,
    *,
    slot: StreamSlot,
    expires_at: float,
    heartbeat_seconds: float,
) -> AsyncIterator[dict[str, str | int]]:
    """The session's events after cursor ``after``, then new ones as they are stored, as
    messages for :func:`event_response`.

    Runs until the client disconnects (sse-starlette cancels this generator then), the server
    shuts down (``hub.closing``) or the token expires (``expires_at``, epoch seconds: checked
    before every event and on a timer; a last ``token_expired`` event says so). ``slot`` (from
    :meth:`StreamHub.reserve`) is given back when it ends.
    """
    hub = slot.hub
    cursor = after
    log.info("event stream opened", extra={"action": "event_stream_opened",
                                           "session_id": session_id, "after": after})
    try:
        # Tell EventSource how soon to reconnect after a drop.
        yield {"retry": RECONNECT_MILLISECONDS}
        read_at = time.monotonic()
        woken = True  # read at once
        while not hub.closing:
            if time.time() >= expires_at:
                yield _expired(expires_at)
                return
            waiter = hub.waiter(session_id)
            if woken or time.monotonic() - read_at >= heartbeat_seconds:
                read_at = time.monotonic()
                # The store is synchronous: read it in a worker thread, never on the loop.
                batch = await anyio.to_thread.run_sync(client.events, session_id, cursor)
                for event in batch:
                    if time.time() >= expires_at:
                        yield _expired(expires_at)
                        return
                    cursor = event.id
                    yield sse_message(event)
                if batch:
                    woken = True  # a full batch may mean more are waiting: read again
                    continue
            # Wake for new events, and at least every half second (expiry and shutdown are
            # checked then; no store read unless there is news or a heartbeat's time passed).
            timeout = max(0.0, min(_TICK_SECONDS, expires_at - time.time()))
            await hub.wait(session_id, waiter, timeout)
            woken = waiter.is_set()
    finally:
        slot.release()
        log.info("event stream closed", extra={"action": "event_stream_closed",
                                               "session_id": session_id, "cursor": cursor})


_TICK_SECONDS = 0.5


def _expired(expires_at: float) -> dict[str, str | int]:
    data = json.dumps({"expired_at": expires_at,
                       "detail": "the token expired: open the page with a new link"})
    return {"event": "token_expired", "data": data}
