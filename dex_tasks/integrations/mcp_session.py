"""One long-lived MCP session per worker process, for :mod:`dex_tasks.integrations.mcp`.

A :class:`ServerConnection` knows how to reach one MCP server (a command run over stdio, or a
streamable HTTP URL) and holds this process's session with it: opened on the process's first
call (a stdio server starts in a second or two; a call on an open session takes a few
milliseconds), kept by an event loop in a daemon thread of the process, and replaced when it
breaks. Nothing crosses a fork: the tools are listed over a session of their own, closed before
:func:`ServerConnection.list_tools` returns (the worker forks its children after importing the
tools module), and a forked child never touches the session of its parent.

Each call carries its idempotency key in the request's ``_meta`` (:data:`IDEMPOTENCY_META_KEY`).
The transports are watched so that a broken session says whether the call reached the server:

* it did not (the server exited while the session was idle, an HTTP connection was refused, a
  restarted HTTP server answered 404 for a session it no longer knew): the call is sent again
  once on a fresh session; if none can be opened, :class:`dex_tasks.TransientToolError` with a
  message that says the tool did not run;
* it may have (the server was killed mid-call), or no answer came within the timeout:
  :class:`dex_tasks.OutcomeUnknownError`. A stdio server that dies in the instant a request is
  written to its pipe is counted here too: the safe side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    OutcomeUnknownError,
    ToolDefinitionError,
    TransientToolError,
)
from dex_tasks.integrations.extras import needs_extra

with needs_extra("mcp", "dex_tasks.integrations.mcp"):
    import anyio
    import httpx2
    from mcp import Client, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError
    from mcp.shared.message import SessionMessage
    from mcp.types import (
        CONNECTION_CLOSED,
        REQUEST_TIMEOUT,
        CallToolResult,
        JSONRPCRequest,
        RequestParamsMeta,
    )
    from mcp.types import Tool as MCPTool

log = logging.getLogger("dex_tasks.integrations.mcp")

IDEMPOTENCY_META_KEY = "dex/idempotency_key"
"""The ``_meta`` entry of each ``tools/call`` request that carries the call's idempotency key
(the same for every attempt of one call). MCP has no standard field for it yet (SEP-3182
proposed one); a server that reads this entry can drop duplicates."""

_LIST_PAGES_MAX = 1000
# What an HTTP client raises when a request never reached the server: no connection was made.
_NOT_CONNECTED = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)

T = TypeVar("T")


class MCPServerError(Exception):
    """The MCP server answered the request with a JSON-RPC error (an unknown tool, arguments it
    refused): it did not run the tool. The call ends ``failed``."""


# -- which server -------------------------------------------------------------------------------


class ServerConnection:
    """How to reach one MCP server, and this process's session with it.

    ``spec`` is a URL (``http://``/``https://``), a command (a string or a list of strings) or
    ``mcp.StdioServerParameters``; ``headers`` go with every HTTP request; ``timeout`` bounds
    a call's answer, ``connect_timeout`` the opening of a session. Bad values raise
    :class:`dex_tasks.ToolDefinitionError`.
    """

    def __init__(self, spec: str | Sequence[str] | StdioServerParameters,
                 headers: Mapping[str, str] | None, timeout: float,
                 connect_timeout: float) -> None:
        self.url: str | None = None
        self.stdio: StdioServerParameters | None = None
        if isinstance(spec, StdioServerParameters):
            self.stdio = spec
        elif isinstance(spec, str) and spec.startswith(("http://", "https://")):
            self.url = spec
        elif isinstance(spec, str):
            argv = shlex.split(spec)
            if not argv:
                raise ToolDefinitionError("mcp_tools: server is an empty command")
            self.stdio = StdioServerParameters(command=argv[0], args=argv[1:])
        elif isinstance(spec, Sequence) and spec and all(isinstance(a, str) for a in spec):
            self.stdio = StdioServerParameters(command=spec[0], args=list(spec[1:]))
        else:
            raise ToolDefinitionError(
                "mcp_tools: server must be a URL (http:// or https://), a command (a string or "
                f"a list of strings) or mcp.StdioServerParameters, got {spec!r}"
            )
        if headers is not None and self.url is None:
            raise ToolDefinitionError("mcp_tools: headers= applies to an HTTP server only")
        for field, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ToolDefinitionError(f"mcp_tools: {field} must be a positive number of "
                                          f"seconds, got {value!r}")
        self.headers = dict(headers or {})
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.label = self._label()
        self._link: _Link | None = None
        self._lock = threading.Lock()
        # A lock held by another thread when the worker forks would stay locked in the child.
        os.register_at_fork(after_in_child=self._after_fork)

    def _label(self) -> str:
        """How logs and errors name the server: never a URL's credentials or query, never the
        stdio environment (where secrets belong)."""
        if self.url is not None:
            url = httpx2.URL(self.url)
            port = f":{url.port}" if url.port else ""
            return f"{url.scheme}://{url.host}{port}{url.path}"
        assert self.stdio is not None
        return shlex.join([self.stdio.command, *self.stdio.args])

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def _this_process(self) -> _Link:
        """This process's link, created on first use (and again in a forked child)."""
        link = self._link
        if link is not None and link.pid == os.getpid():
            return link
        with self._lock:
            if self._link is None or self._link.pid != os.getpid():
                # An inherited link belongs to the parent: its thread does not exist here and
                # its pipes or sockets are the parent's. Leave it alone and start over.
                self._link = _Link(self)
            return self._link

    def close(self) -> None:
        """Close this process's session, if it has one; the next call opens a new one."""
        with self._lock:
            link, self._link = self._link, None
        if link is not None and link.pid == os.getpid():
            link.close()

    def call(self, name: str, arguments: dict[str, Any], key: str) -> CallToolResult:
        """Call tool ``name`` on this process's session (opened if need be); see the module
        docstring for what a broken session becomes."""
        link = self._this_process()
        return link.run(link.call(name, arguments, key))

    def list_tools(self) -> list[MCPTool]:
        """The server's tools, listed over a session of their own that is closed (with its
        thread) before this returns. Raises :class:`dex_tasks.ToolDefinitionError`."""
        link = _Link(self)
        try:
            return link.run(link.list_tools())
        except ToolDefinitionError:
            raise
        except Exception as err:
            # A failed connection arrives as TransientToolError (what a call raises); say
            # what really went wrong.
            cause = (err.__cause__ if isinstance(err, TransientToolError) and err.__cause__
                     else err)
            raise ToolDefinitionError(f"mcp_tools: could not list the tools of {self.label}: "
                                      f"{describe(cause)}") from err
        finally:
            # Nothing of this session may outlive the import: the worker forks after it.
            link.close()

    def transport(self, session: _Session) -> Any:
        """A fresh transport for one session, watched so we know what reached the server."""
        if self.url is not None:
            http = httpx2.AsyncClient(
                transport=_WatchedHTTP(httpx2.AsyncHTTPTransport(), session),
                headers=self.headers,
                # A tool may take long to answer; the call's own timeout bounds the wait.
                timeout=httpx2.Timeout(self.connect_timeout, read=None),
            )
            return _WatchedTransport(streamable_http_client(self.url, http_client=http), session,
                                     closing=http)
        assert self.stdio is not None
        return _WatchedTransport(stdio_client(self.stdio), session)


# -- what reached the server --------------------------------------------------------------------


def _request_key(message: Any) -> str | None:
    """The idempotency key of a ``tools/call`` request we sent, else None."""
    if not isinstance(message, JSONRPCRequest) or message.method != "tools/call":
        return None
    meta = (message.params or {}).get("_meta") or {}
    key = meta.get(IDEMPOTENCY_META_KEY)
    return key if isinstance(key, str) else None


class _WatchedWrite:
    """The session's write stream: notes each call handed to the transport.

    A request the stream refused (the transport had already closed) never left this process.
    """

    def __init__(self, inner: Any, session: _Session) -> None:
        self.inner = inner
        self.session = session

    async def send(self, item: SessionMessage, /) -> None:
        key = _request_key(item.message)
        if key is not None:
            self.session.on_wire.add(key)
        try:
            await self.inner.send(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            if key is not None:
                self.session.on_wire.discard(key)
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> _WatchedWrite:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        return bool(await self.inner.__aexit__(exc_type, exc, tb))


class _WatchedTransport:
    """An MCP transport whose write side is a :class:`_WatchedWrite`."""

    def __init__(self, inner: Any, session: _Session, closing: Any = None) -> None:
        self.inner = inner
        self.session = session
        self.closing = closing

    async def __aenter__(self) -> tuple[Any, Any]:
        read, write = await self.inner.__aenter__()
        return read, _WatchedWrite(write, self.session)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        try:
            return bool(await self.inner.__aexit__(exc_type, exc, tb))
        finally:
            if self.closing is not None:
                await self.closing.aclose()


class _WatchedHTTP(httpx2.AsyncBaseTransport):
    """HTTP transport that notes the calls the server never ran though the MCP session
    reports them like any failed request: a POST that could not connect (the server was down),
    and one answered 404 for its session id (the server restarted and forgot the session; the
    streamable HTTP spec says the client must start a new session then)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, session: _Session) -> None:
        self.inner = inner
        self.session = session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self.inner.handle_async_request(request)
        except _NOT_CONNECTED:
            self._did_not_run(request)
            raise
        if response.status_code == 404 and "mcp-session-id" in request.headers:
            self._did_not_run(request)
        return response

    def _did_not_run(self, request: httpx2.Request) -> None:
        key = _posted_key(request)
        if key is not None:
            self.session.did_not_run.add(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _posted_key(request: httpx2.Request) -> str | None:
    try:
        body = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return None
    if not isinstance(body, dict) or body.get("method") != "tools/call":
        return None
    meta = (body.get("params") or {}).get("_meta") or {}
    key = meta.get(IDEMPOTENCY_META_KEY)
    return key if isinstance(key, str) else None


# -- one session --------------------------------------------------------------------------------


class _Session:
    """One MCP session, held open by a task of the link's event loop until retired.

    anyio task groups (inside the MCP client) must be left by the task that entered them, so
    one task enters the client, waits until the session is retired, and leaves it; calls run in
    tasks of their own on the same loop.
    """

    def __init__(self, server: ServerConnection) -> None:
        self.server = server
        self.client: Client | None = None
        self.error: BaseException | None = None
        # Keys of the calls handed to the transport, and of those known not to have run.
        self.on_wire: set[str] = set()
        self.did_not_run: set[str] = set()
        self.retired = False
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> Client:
        """Connect and complete the handshake; raises what went wrong (``TimeoutError`` after
        ``connect_timeout``)."""
        started = time.perf_counter()
        self._task = asyncio.create_task(self._hold())
        try:
            await asyncio.wait_for(self._ready.wait(), self.server.connect_timeout)
        except TimeoutError:
            await self.close()
            raise TimeoutError(f"no MCP session within {self.server.connect_timeout}s") from None
        if self.client is None:
            await self.close()
            assert self.error is not None
            raise self.error
        log.info("MCP session opened", extra={
            "action": "mcp_session_opened", "server": self.server.label,
            "seconds": round(time.perf_counter() - started, 3)})
        return self.client

    async def _hold(self) -> None:
        try:
            async with Client(self.server.transport(self)) as client:
                self.client = client
                self._ready.set()
                await self._stop.wait()
        except BaseException as err:  # noqa: BLE001 - recorded; the callers decide
            self.error = err
        finally:
            self.retired = True
            self._ready.set()

    def retire(self) -> None:
        """Stop using this session; its task leaves the client (closing the transport and, for
        stdio, ending the server process) in the background."""
        self.retired = True
        self._stop.set()

    async def close(self) -> None:
        """Retire and wait until the session is fully closed."""
        self.retire()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task

    def reached_server(self, key: str) -> bool:
        """Whether the request of this call may have reached the server."""
        return key in self.on_wire and key not in self.did_not_run

    def forget(self, key: str) -> None:
        self.on_wire.discard(key)
        self.did_not_run.discard(key)


# -- one process's link -------------------------------------------------------------------------


class _Link:
    """One process's connection to one server: an event loop in a daemon thread, and the
    current session on it, opened on first use and replaced when it breaks."""

    def __init__(self, server: ServerConnection) -> None:
        self.server = server
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name=f"dex-mcp-{self.pid}")
        self.thread.start()
        self.session: _Session | None = None
        self._opening: asyncio.Lock | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the link's loop and wait for it in the calling thread.

        If the wait is interrupted (Celery's soft time limit raises in the calling thread),
        the request is cancelled too, so it does not linger on the session.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def current(self) -> _Session:
        """The open session, opening one if there is none or the last one broke."""
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            session = self.session
            if session is not None and not session.retired:
                return session
            session = _Session(self.server)
            try:
                await session.open()
            except Exception as err:
                log.warning("could not open an MCP session", extra={
                    "action": "mcp_connect_failed", "server": self.server.label,
                    "error": describe(err)})
                raise TransientToolError(
                    f"{TOOL_DID_NOT_RUN}: could not connect to the MCP server "
                    f"{self.server.label}: {describe(err)}"
                ) from err
            self.session = session
            return session

    async def list_tools(self) -> list[MCPTool]:
        session = await self.current()
        assert session.client is not None
        try:
            return await asyncio.wait_for(_all_tools(session.client), self.server.timeout)
        except TimeoutError:
            raise TimeoutError(f"no tool list within {self.server.timeout}s") from None

    async def call(self, name: str, arguments: dict[str, Any], key: str) -> CallToolResult:
        """Call tool ``name`` once; see the module docstring for what each failure becomes."""
        for attempt in (1, 2):
            session = await self.current()
            assert session.client is not None
            try:
                return await session.client.call_tool(
                    name, arguments, read_timeout_seconds=self.server.timeout,
                    meta=cast(RequestParamsMeta, {IDEMPOTENCY_META_KEY: key}),
                )
            except MCPError as err:
                if err.code == REQUEST_TIMEOUT:
                    raise OutcomeUnknownError(
                        f"the MCP server {self.server.label} sent no answer to {name!r} within "
                        f"{self.server.timeout}s"
                    ) from err
                if err.code != CONNECTION_CLOSED and key not in session.did_not_run:
                    raise MCPServerError(
                        f"the MCP server {self.server.label} refused the call of {name!r} "
                        f"(it did not run): {err}"
                    ) from err
                # The session is gone (closed, or forgotten by a restarted server).
                session.retire()
                why = describe(session.error) if session.error else str(err)
                log.warning("MCP session lost", extra={
                    "action": "mcp_session_lost", "server": self.server.label, "key": key,
                    "reached_server": session.reached_server(key), "error": why})
                if session.reached_server(key):
                    raise OutcomeUnknownError(
                        f"the connection to the MCP server {self.server.label} was lost after "
                        f"the call of {name!r} was sent ({why})"
                    ) from err
                if attempt == 2:
                    raise TransientToolError(
                        f"{TOOL_DID_NOT_RUN}: the MCP session with {self.server.label} broke "
                        f"before the call reached the server ({why})"
                    ) from err
                # It never reached the server: a fresh session may serve it.
            finally:
                session.forget(key)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Close the session and stop the loop's thread (after listing, before a fork)."""
        async def shut() -> None:
            if self.session is not None:
                await self.session.close()
            # Sessions retired earlier may still be closing (a stdio server is given two
            # seconds to exit): let them finish, so no task is destroyed while pending.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:
                _, pending = await asyncio.wait(others, timeout=10)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=5)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()


async def _all_tools(client: Client) -> list[MCPTool]:
    tools: list[MCPTool] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGES_MAX):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools
    raise ToolDefinitionError(f"the MCP server's tool list did not end after "
                              f"{_LIST_PAGES_MAX} pages")


def describe(err: BaseException) -> str:
    """One line about an error, looking inside the exception groups anyio raises."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
