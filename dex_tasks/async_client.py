"""AsyncDexClient: the DexClient API for asyncio agent loops.

Each method runs the matching blocking :class:`DexClient` call in a worker thread
(``asyncio.to_thread``), so the event loop keeps running while the store or the broker answers;
:meth:`AsyncDexClient.wait` polls with ``asyncio.sleep`` in between. There is one store and one
publishing path, shared with the sync client, so both behave the same way.

Cancelling an awaited call cancels the wait, not the work: a ``call_tool`` whose thread already
started still records (and may start) the call. That is safe, because calling again with the
same ids returns the same record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from dex_tasks.client import DexClient
from dex_tasks.policy import EffectClass
from dex_tasks.records import AgentSnapshot, CallEvent, SessionMessage, ToolCallRecord
from dex_tasks.settings import DexSettings


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

    async def get_tool_call(self, key: str) -> ToolCallRecord:
        """The call's record; :class:`CallNotFoundError` if no call has that key."""
        return await asyncio.to_thread(self.sync.get_tool_call, key)

    async def wait(self, key: str, timeout: float = 30.0) -> ToolCallRecord:
        """Wait until the call is terminal and return it; ``TimeoutError`` after ``timeout``.

        Polls the store (in a thread), sleeping with ``asyncio.sleep`` in between: 5 ms at
        first, doubling up to 200 ms, so short calls return quickly and long ones cost little.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.005
        while True:
            record = await self.get_tool_call(key)
            if record.terminal:
                return record
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"call {key!r} is still {record.status.value} after {timeout}s"
                )
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.2)

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
