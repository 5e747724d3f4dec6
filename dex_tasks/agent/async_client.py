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
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from dex_tasks.agent.calls import ToolCallRequest
from dex_tasks.agent.client import FAST_POLL_FIRST, DexClient, next_pause
from dex_tasks.policy import EffectClass
from dex_tasks.settings import DexSettings
from dex_tasks.store.catalog import ToolSpec
from dex_tasks.store.records import AgentSnapshot, CallEvent, SessionMessage, ToolCallRecord


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

    # -- calls ----------------------------------------------------------------------------------

    async def call_tool(
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
        """Record a tool call and start it (or hold it for approval); see
        :meth:`DexClient.call_tool`."""
        return await asyncio.to_thread(
            lambda: self.sync.call_tool(
                session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id, tool=tool,
                arguments=arguments, default_effect=default_effect,
                approval_deadline=approval_deadline, expires_in=expires_in,
            )
        )

    async def call_tools(
        self,
        calls: Sequence[ToolCallRequest | Mapping[str, Any]],
        *,
        session_id: str,
        turn_id: str,
        default_effect: EffectClass | str | None = None,
        approval_deadline: float | timedelta | None = None,
        expires_in: float | timedelta | None = None,
    ) -> list[ToolCallRecord]:
        """Record a turn's parallel calls in one transaction and start them with one Redis
        round trip, all or nothing; see :meth:`DexClient.call_tools`."""
        return await asyncio.to_thread(
            lambda: self.sync.call_tools(
                calls, session_id=session_id, turn_id=turn_id, default_effect=default_effect,
                approval_deadline=approval_deadline, expires_in=expires_in,
            )
        )

    async def list_tools(
        self, default_effect: EffectClass | str | None = None
    ) -> list[ToolSpec]:
        """The published tools; see :meth:`DexClient.list_tools`."""
        return await asyncio.to_thread(self.sync.list_tools, default_effect)

    async def get_tool_call(self, key: str) -> ToolCallRecord:
        """The call's record; :class:`CallNotFoundError` if no call has that key."""
        return await asyncio.to_thread(self.sync.get_tool_call, key)

    async def wait(self, key: str, timeout: float = 30.0) -> ToolCallRecord:
        """Wait until the call is terminal and return it; ``TimeoutError`` after ``timeout``.

        Woken by the Redis notification sent when the call ends, like
        :meth:`DexClient.wait`; the store is read (in a thread) on every wake-up and every
        ``wait_poll_seconds`` regardless, and every 5-200 ms while Redis cannot be reached.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        record = await self.get_tool_call(key)
        if record.terminal:
            return record
        woken = asyncio.Event()

        def wake() -> None:  # from the watcher's thread
            loop.call_soon_threadsafe(woken.set)

        fast = FAST_POLL_FIRST
        with self.sync.watcher.watch(key, on_wake=wake) as watch:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(
                        f"call {key!r} is still {record.status.value} after {timeout}s"
                    )
                pause, fast = next_pause(watch.live, fast, self.settings.wait_poll_seconds)
                try:
                    await asyncio.wait_for(woken.wait(), min(pause, remaining))
                except TimeoutError:
                    pass
                woken.clear()
                record = await self.get_tool_call(key)
                if record.terminal:
                    return record

    async def get_agent_snapshot(self, session_id: str) -> AgentSnapshot:
        """The session as one consistent read; see :meth:`DexClient.get_agent_snapshot`."""
        return await asyncio.to_thread(self.sync.get_agent_snapshot, session_id)

    async def resolve_interrupt(
        self,
        session_id: str,
        interrupt_id: str,
        approved: bool,
        rejection_message: str | None = None,
        approver: str | None = None,
    ) -> bool:
        """Approve or reject a pending call; True if this call decided, False otherwise."""
        return await asyncio.to_thread(
            lambda: self.sync.resolve_interrupt(
                session_id, interrupt_id, approved,
                rejection_message=rejection_message, approver=approver,
            )
        )

    async def send_user_message(self, session_id: str, text: str) -> bool:
        """Send a user message into the session's transcript; True once it is stored (see
        :meth:`DexClient.send_user_message` for the one case that returns False)."""
        return await asyncio.to_thread(self.sync.send_user_message, session_id, text)

    async def add_assistant_message(
        self, session_id: str, turn_id: str, text: str
    ) -> SessionMessage:
        """Record the model's own text of turn ``turn_id`` in the session's transcript."""
        return await asyncio.to_thread(self.sync.add_assistant_message, session_id, turn_id,
                                       text)

    async def events(self, session_id: str, after: int = 0) -> list[CallEvent]:
        """The session's events after cursor ``after`` (an event's ``id``)."""
        return await asyncio.to_thread(self.sync.events, session_id, after)
