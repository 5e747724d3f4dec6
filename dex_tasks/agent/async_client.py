"""AsyncDexClient: the DexClient API for asyncio agent loops.

Each method runs the matching blocking :class:`DexClient` call in a worker thread
(``asyncio.to_thread``), so the event loop keeps running while the store or the broker answers.
:meth:`AsyncDexClient.wait` sleeps on an ``asyncio.Event`` that the sync client's Redis watcher
sets when the call ends (see ``notify.py``), so many waits at once hold no thread and no
connection each. There is one store and one publishing path, shared with the sync client, so
both behave the same way.

Cancelling an awaited call cancels the wait, not the work: a ``call_tool`` whose thread already
started still records (and may start) the call. That is safe, because calling again with the
same ids returns the same record.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from dex_tasks.agent.client import DexClient
from dex_tasks.agent.session_methods import WaitPauses
from dex_tasks.settings import DexSettings
from dex_tasks.store.records import ToolCallRecord

P = ParamSpec("P")
R = TypeVar("R")


def in_thread(
    method: Callable[Concatenate[DexClient, P], R],
) -> Callable[Concatenate[AsyncDexClient, P], Coroutine[Any, Any, R]]:
    """The coroutine form of a :class:`DexClient` method: the same signature, docstring and
    behaviour, run in a worker thread (``asyncio.to_thread``) on the wrapped client. One
    implementation serves both clients, so they cannot drift apart."""

    @functools.wraps(method)
    async def run(self: AsyncDexClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(method, self.sync, *args, **kwargs)

    return run


class AsyncDexClient:
    """Runs tool calls and reads their records without blocking the event loop.

    Construct it like :class:`DexClient` (creating the tables, if asked, happens here, once), or
    wrap an existing one with ``AsyncDexClient(client=...)``. Use ``async with`` or ``await
    client.close()`` to release its connections.
    """

    def __init__(
        self,
        settings: DexSettings | None = None,
        *,
        create_tables: bool = True,
        client: DexClient | None = None,
    ) -> None:
        self.sync = client if client is not None else DexClient(
            settings, create_tables=create_tables
        )
        # Create the Celery app now: DexClient.app creates it lazily, and two threads racing
        # on first use would each build one.
        _ = self.sync.app

    @classmethod
    def from_env(cls) -> AsyncDexClient:
        """A client configured from the ``DEX_*`` environment variables."""
        return cls(DexSettings())

    @property
    def settings(self) -> DexSettings:
        """The settings of the underlying client."""
        return self.sync.settings

    async def close(self) -> None:
        """Release broker and database connections."""
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncDexClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- the DexClient methods, as coroutines (see in_thread) ----------------------------------

    call_tool = in_thread(DexClient.call_tool)
    call_tools = in_thread(DexClient.call_tools)
    list_tools = in_thread(DexClient.list_tools)
    get_tool_call = in_thread(DexClient.get_tool_call)
    get_agent_snapshot = in_thread(DexClient.get_agent_snapshot)
    resolve_interrupt = in_thread(DexClient.resolve_interrupt)
    why_not_resolved = in_thread(DexClient.why_not_resolved)
    send_user_message = in_thread(DexClient.send_user_message)
    add_assistant_message = in_thread(DexClient.add_assistant_message)
    begin_turn = in_thread(DexClient.begin_turn)
    record_step = in_thread(DexClient.record_step)
    end_turn = in_thread(DexClient.end_turn)
    open_turn = in_thread(DexClient.open_turn)
    events = in_thread(DexClient.events)

    async def wait(self, key: str, timeout: float = 30.0) -> ToolCallRecord:
        """Wait until the call is terminal and return it; ``TimeoutError`` after ``timeout``.

        Woken by the Redis notification sent when the call ends, like
        :meth:`DexClient.wait`, which hands over the ended record (signed, checked here) when
        it can; otherwise the store is read (in a thread) on every wake-up and every
        ``wait_poll_seconds`` regardless, and every 5-200 ms while Redis cannot be reached.
        """
        loop = asyncio.get_running_loop()
        pauses = WaitPauses(key, timeout, self.settings.wait_poll_seconds)
        woken = asyncio.Event()

        def wake() -> None:  # from the watcher's thread
            loop.call_soon_threadsafe(woken.set)

        sent = self.sync._watch_sent(key, on_wake=wake)
        if sent is not None:
            # A call this client sent while its session's ends reached it: no read first.
            with sent:
                while sent.message is None and sent.covered:
                    pause = pauses.next(live=True)
                    if pause is None:
                        break
                    try:
                        await asyncio.wait_for(woken.wait(), pause)
                    except TimeoutError:
                        break  # a poll is due: the store says
                    woken.clear()
            handed = self.sync._handed(sent, key) if sent.message is not None else None
            if handed is not None:
                return handed
        # The store alone, as DexClient.wait reads it (the timeout's answer shows a run).
        record = await asyncio.to_thread(self.sync._stored_call, key)
        if record.terminal:
            return record
        woken.clear()

        with self.sync.watcher.watch(key, on_wake=wake) as watch:
            while True:
                pause = pauses.next(watch.live)
                if pause is None:
                    return pauses.timed_out(await self.get_tool_call(key))
                try:
                    await asyncio.wait_for(woken.wait(), pause)
                except TimeoutError:
                    pass
                woken.clear()
                handed = self.sync._handed(watch, key)
                if handed is not None:
                    return handed
                record = await asyncio.to_thread(self.sync._stored_call, key)
                if record.terminal:
                    return record
