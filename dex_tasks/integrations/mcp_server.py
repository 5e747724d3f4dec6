"""dex-tasks as an MCP server: the published catalog, with dex semantics, for any MCP client.

    dex-tasks mcp --session support-42                    # stdio, for a local agent
    dex-tasks mcp --http --port 8765 --page-url https://dex.example.com
    # an MCP client then connects with: Authorization: Bearer $(dex-tasks token support-42)

Each tool of the catalog the workers published (``client.list_tools()``) is listed with its
JSON schema, its description and annotations taken from its dex policy (``readOnlyHint`` for a
read, ``idempotentHint`` for a read or an idempotent write, ``destructiveHint`` for the
single-attempt classes), and the policy itself in the tool's ``_meta`` (``dex/effect``,
``dex/requires_approval``). Each ``tools/call`` becomes one dex call (``call_tool``):

* **The session** is the token's on HTTP (``Authorization: Bearer``, the API's signed tokens,
  checked before anything of the request is read; an operator token takes ``--session`` or
  the request's ``_meta["dex/session_id"]``); on stdio it is ``--session`` (or
  ``DEX_MCP_SESSION``), else one of its own per server process.
* **The key's turn and call ids** are the request's ``_meta["dex/turn_id"]`` and
  ``_meta["dex/tool_call_id"]`` when the client sends them: a client that keeps them across its
  own restarts never runs a tool twice. Otherwise they are derived from the connection and the
  JSON-RPC request id (``mcp-<connection>`` / ``rpc-<request id>``; the connection is the HTTP
  ``Mcp-Session-Id``, or the stdio server process), so a request the client sends again on the
  same connection finds its call instead of starting another. Over HTTP the server speaks the
  session-ful protocol (it declines the 2026 sessionless handshake), so every connection has an
  id to derive keys from.
* **A call that needs approval** waits for the decision, sending progress notifications (when
  the client asked for progress) every ``progress_interval`` seconds, up to
  ``approval_timeout``; then the result (``isError``) says the call awaits a person's approval,
  gives the approval page's link (``page_url``) and says to call again with the same ids to
  get the outcome. The page link never carries a token: the model must not approve its calls.
* **Outcomes**: a succeeded call is the tool's result (JSON text, and ``structuredContent``
  for an object); every other end is a result with ``isError`` and the dex text the model
  reads (``the tool did not run, so it is safe to call again...``,
  ``OUTCOME_UNKNOWN_TOOL_RESULT...``, a rejection with the person's message). Each result's
  ``_meta`` has ``dex/key`` and ``dex/status``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dex_tasks import (
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallStatus,
    DexError,
    DexSettings,
    EffectClass,
    ForbiddenSessionError,
    InvalidArgumentError,
    InvalidCallError,
    ToolCallRecord,
    ToolSpec,
    token_identity,
    tool_message_text,
)
from dex_tasks.integrations.extras import needs_extra

with needs_extra("mcp", "dex_tasks.integrations.mcp_server"):
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server
    from mcp.shared.exceptions import MCPError

# After the SDK: without the extra, the line that names it names this module.
from dex_tasks.integrations.mcp_gate import (
    CLAIMS_STATE,
    DEFAULT_MAX_REQUESTS_PER_TOKEN,
    DEFAULT_MAX_SESSIONS_PER_TOKEN,
    SESSION_IDLE_TIMEOUT,
    TOKEN_STATE,
    TokenGate,
)

__all__ = [
    "AWAITING_APPROVAL",
    "SESSION_META",
    "TOOL_CALL_META",
    "TURN_META",
    "DexMCPServer",
    "HttpLimits",
    "serve",
    "serve_http",
    "serve_stdio",
]

log = logging.getLogger("dex_tasks.integrations.mcp_server")

SESSION_META = "dex/session_id"
"""``_meta`` entry of a ``tools/call`` naming the dex session (operator tokens and stdio)."""
TURN_META = "dex/turn_id"
"""``_meta`` entry of a ``tools/call`` naming the turn: part of the call's idempotency key."""
TOOL_CALL_META = "dex/tool_call_id"
"""``_meta`` entry of a ``tools/call`` naming the model's tool-call id: part of the key."""
AWAITING_APPROVAL = "DEX_AWAITING_APPROVAL"
"""How the result of a call still waiting for a person when the server stops waiting begins."""

# An id goes into a key as it is when it is short and plain; otherwise a hash stands for it.
_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_TOOLS_CACHE_SECONDS = 2.0


class DexMCPServer:
    """The MCP server's handlers over one :class:`AsyncDexClient`.

    ``session_id`` is the session of a stdio server, and of HTTP requests made with an
    operator token that name none; ``approval_timeout`` and ``call_timeout`` bound how long a
    ``tools/call`` waits for a person and for the tool; ``page_url`` is the API's address, for
    the link to a session's approval page.
    """

    def __init__(self, client: AsyncDexClient, *, session_id: str | None = None,
                 approval_timeout: float = 60.0, call_timeout: float = 120.0,
                 progress_interval: float = 2.0, page_url: str | None = None,
                 default_effect: EffectClass | str | None = None) -> None:
        for field, value in (("approval_timeout", approval_timeout),
                             ("call_timeout", call_timeout),
                             ("progress_interval", progress_interval)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidArgumentError(
                    f"{field} must be a positive number of seconds, got {value!r}")
        self.client = client
        self.session_id = session_id
        self.approval_timeout = float(approval_timeout)
        self.call_timeout = float(call_timeout)
        self.progress_interval = float(progress_interval)
        self.page_url = page_url.rstrip("/") if page_url else None
        self.default_effect = default_effect
        # A stdio server serves one connection for its whole life: the process is the
        # connection, and this id tells its requests apart from another process's.
        self.connection_id = uuid.uuid4().hex
        self._tools: tuple[float, dict[str, ToolSpec]] | None = None

    def server(self, *, sessions_required: bool = False) -> Server[Any]:
        """The low-level MCP ``Server`` with this object's handlers.

        ``sessions_required`` declines the 2026 sessionless protocol (``server/discover``), so
        clients fall back to the handshake and every HTTP connection has a session id.
        """
        server: Server[Any] = Server(
            "dex-tasks", version="1",
            instructions=("Tools run through dex-tasks: writes may wait for a person's "
                          "approval; an error that says the tool did not run is safe to retry."),
            on_list_tools=self.list_tools, on_call_tool=self.call_tool,
        )
        if sessions_required:
            server.middleware.insert(0, _decline_sessionless)
        return server

    # -- tools/list -----------------------------------------------------------------------------

    async def catalog(self) -> dict[str, ToolSpec]:
        """The published tools by name, read again after a couple of seconds."""
        now = time.monotonic()
        if self._tools is None or now - self._tools[0] > _TOOLS_CACHE_SECONDS:
            specs = await self.client.list_tools(self.default_effect)
            self._tools = (now, {spec.name: spec for spec in specs})
        return self._tools[1]

    async def list_tools(self, ctx: Any, params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        """Every published tool, with its schema, annotations and dex policy."""
        return types.ListToolsResult(
            tools=[mcp_tool(spec) for spec in (await self.catalog()).values()])

    # -- tools/call -----------------------------------------------------------------------------

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        """Run one ``tools/call`` as a dex call and answer with its outcome."""
        meta: dict[str, Any] = dict(params.meta or {})
        try:
            session_id = self._session(ctx, meta)
            turn_id, tool_call_id = self._call_ids(ctx, meta)
        except DexError as err:
            return _error(f"{TOOL_DID_NOT_RUN}: {err}")
        if params.name not in await self.catalog():
            self._tools = None  # a tool published a moment ago: read the catalog again
            if params.name not in await self.catalog():
                return _error(f"{TOOL_DID_NOT_RUN}: there is no tool {params.name!r}")
        try:
            record = await self.client.call_tool(
                session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id,
                tool=params.name, arguments=params.arguments or {},
                default_effect=self.default_effect, requested_by=_caller(ctx),
            )
        except DexError as err:
            # Refused before anything was stored (bad ids, a conflicting repeat): nothing ran.
            return _error(f"{TOOL_DID_NOT_RUN}: {err}")
        log.info("mcp call", extra={"action": "mcp_call", "key": record.key,
                                    "tool": params.name, "status": record.status.value})
        return await self._outcome(ctx, record)

    async def _outcome(self, ctx: Any, record: ToolCallRecord) -> types.CallToolResult:
        """Wait for the call, with progress notifications, up to the timeouts."""
        started = time.monotonic()
        approval_until = started + self.approval_timeout
        call_until = started + self.call_timeout
        while not record.terminal:
            now = time.monotonic()
            waiting = record.status is CallStatus.AWAITING_APPROVAL
            until = approval_until if waiting else call_until
            if now >= until:
                return self._unfinished(record)
            await _progress(ctx, now - started, self._progress_text(record))
            try:
                record = await self.client.wait(
                    record.key, timeout=min(self.progress_interval, until - now))
            except TimeoutError:
                record = await self.client.get_tool_call(record.key)
            if waiting and record.status is not CallStatus.AWAITING_APPROVAL:
                # Approved: the tool's own time starts now.
                call_until = time.monotonic() + self.call_timeout
        return _result(record)

    def _page(self, session_id: str) -> str:
        if self.page_url is None:
            return f"the session's approval page (dex-tasks api: /sessions/{session_id})"
        return f"{self.page_url}/sessions/{session_id}"

    def _progress_text(self, record: ToolCallRecord) -> str:
        if record.status is CallStatus.AWAITING_APPROVAL:
            return (f"call {record.key} awaits a person's approval (interrupt "
                    f"{record.interrupt_id}): {self._page(record.session_id)}")
        return f"call {record.key} is {record.status.value}"

    def _unfinished(self, record: ToolCallRecord) -> types.CallToolResult:
        ids = (f'_meta {{"{TURN_META}": "{record.turn_id}", '
               f'"{TOOL_CALL_META}": "{record.tool_call_id}"}}')
        if record.status is CallStatus.AWAITING_APPROVAL:
            text = (f"{AWAITING_APPROVAL}: the tool has not run; call {record.key} awaits a "
                    f"person's approval (interrupt {record.interrupt_id}) at "
                    f"{self._page(record.session_id)}. Call the tool again with the same "
                    f"arguments and {ids} to wait for the decision and get the outcome.")
        else:
            text = (f"call {record.key} is still {record.status.value} after "
                    f"{self.call_timeout:g}s; call the tool again with the same arguments and "
                    f"{ids} to get its outcome (it will not run twice).")
        return _error(text, record)

    # -- ids ------------------------------------------------------------------------------------

    def _session(self, ctx: Any, meta: dict[str, Any]) -> str:
        asked = meta.get(SESSION_META)
        if asked is not None and not isinstance(asked, str):
            raise InvalidCallError(f"_meta {SESSION_META} must be a string, got {asked!r}")
        claims = _request_state(ctx, CLAIMS_STATE)
        if claims is not None:  # HTTP: the token decides
            if claims.all_sessions:
                chosen = asked or self.session_id
                if chosen is None:
                    raise ForbiddenSessionError(
                        f"an operator token names no session: send _meta {SESSION_META} or "
                        "start the server with --session")
                return str(chosen)
            if asked is not None and not claims.covers(asked):
                raise ForbiddenSessionError("the token is for another session")
            return str(claims.session_id)
        if self.session_id is not None:
            # stdio pinned by the operator (--session): the client cannot move its calls into
            # another session; naming the same one is harmless.
            if asked is not None and asked != self.session_id:
                raise ForbiddenSessionError(
                    f"this server records its calls in session {self.session_id!r} "
                    f"(--session); _meta {SESSION_META} {asked!r} names another")
            return self.session_id
        return asked or f"mcp-{self.connection_id}"

    def _call_ids(self, ctx: Any, meta: dict[str, Any]) -> tuple[str, str]:
        turn, call = meta.get(TURN_META), meta.get(TOOL_CALL_META)
        if turn is not None or call is not None:
            if not (isinstance(turn, str) and isinstance(call, str)):
                raise InvalidCallError(
                    f"_meta {TURN_META} and {TOOL_CALL_META} go together, as strings; got "
                    f"{turn!r} and {call!r}")
            return turn, call
        request = getattr(ctx, "request", None)
        headers = getattr(request, "headers", None)
        connection = headers.get("mcp-session-id") if headers is not None else None
        return (f"mcp-{_id_part(connection or self.connection_id)}",
                f"rpc-{_id_part(str(ctx.request_id))}")


def _request_state(ctx: Any, name: str) -> Any:
    """An entry the token gate put in the HTTP request's state (None on stdio)."""
    return getattr(getattr(getattr(ctx, "request", None), "state", None), name, None)


def _caller(ctx: Any) -> str | None:
    """Who makes an HTTP call: its token's identity, which may not decide the call's approval
    (None on stdio, where there is no token)."""
    claims, token = _request_state(ctx, CLAIMS_STATE), _request_state(ctx, TOKEN_STATE)
    return token_identity(token, claims) if claims is not None and token else None


def mcp_tool(spec: ToolSpec) -> types.Tool:
    """The MCP form of a published tool: schema, description, annotations from its policy."""
    effect = spec.policy.effect
    hints = spec.hints or {}
    annotations = types.ToolAnnotations(
        read_only_hint=effect is EffectClass.READ,
        idempotent_hint=effect in (EffectClass.READ, EffectClass.IDEMPOTENT_WRITE),
        destructive_hint=effect in (EffectClass.NON_IDEMPOTENT_WRITE, EffectClass.UNCLASSIFIED),
        open_world_hint=hints.get("openWorldHint") if isinstance(
            hints.get("openWorldHint"), bool) else None,
    )
    return types.Tool(
        name=spec.name, description=spec.description or None, input_schema=spec.parameters,
        annotations=annotations,
        meta={"dex/effect": effect.value, "dex/requires_approval": spec.policy.needs_approval},
    )


def _result(record: ToolCallRecord) -> types.CallToolResult:
    """A terminal call as the client reads it."""
    if record.status is not CallStatus.SUCCEEDED:
        return _error(tool_message_text(record), record)
    # The edit note first when a person approved edited arguments.
    text = tool_message_text(record)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        structured_content=record.result if isinstance(record.result, dict) else None,
        is_error=False, meta=_record_meta(record),
    )


def _error(text: str, record: ToolCallRecord | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=True,
                                meta=_record_meta(record) if record is not None else None)


def _record_meta(record: ToolCallRecord) -> dict[str, Any]:
    meta: dict[str, Any] = {"dex/key": record.key, "dex/status": record.status.value}
    if record.interrupt_id is not None:
        meta["dex/interrupt_id"] = record.interrupt_id
    return meta


def _id_part(value: str) -> str:
    """``value`` if it can be part of a key as it is, else a digest that stands for it."""
    if _PLAIN_ID.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


async def _progress(ctx: Any, elapsed: float, message: str) -> None:
    """A progress notification, if the client asked for them; a lost one changes nothing."""
    try:
        await ctx.session.report_progress(round(elapsed, 3), None, message)
    except Exception as err:  # noqa: BLE001 - a client gone away must not end the call
        log.debug("progress not sent: %s", err)


async def _decline_sessionless(ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    # Declining server/discover makes clients use the handshake, which gives each HTTP
    # connection the Mcp-Session-Id that keys are derived from.
    if ctx.method == "server/discover":
        raise MCPError(code=types.METHOD_NOT_FOUND, message="Method not found")
    return await call_next(ctx)


# -- transports ---------------------------------------------------------------------------------


async def serve_stdio(dex: DexMCPServer) -> None:
    """Serve over this process's stdin and stdout until the client closes them."""
    server = dex.server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def http_app(dex: DexMCPServer, secret: str, *, host: str = "127.0.0.1",
             path: str = "/mcp", limits: HttpLimits | None = None) -> Any:
    """The streamable HTTP app (an ASGI app), behind the token gate (``mcp_gate``)."""
    limits = limits or HttpLimits()
    server = dex.server(sessions_required=True)
    app = server.streamable_http_app(streamable_http_path=path, host=host,
                                     max_sessions=limits.max_sessions,
                                     session_idle_timeout=SESSION_IDLE_TIMEOUT)
    return TokenGate(app, secret, max_sessions_per_token=limits.max_sessions_per_token,
                     max_requests_per_token=limits.max_requests_per_token,
                     session_idle_timeout=SESSION_IDLE_TIMEOUT)


def serve_http(dex: DexMCPServer, secret: str, *, host: str = "127.0.0.1", port: int = 8765,
               log_level: str = "info", limits: HttpLimits | None = None) -> None:
    """Serve streamable HTTP at ``http://host:port/mcp`` until interrupted."""
    import uvicorn

    uvicorn.run(http_app(dex, secret, host=host, limits=limits), host=host, port=port,
                log_level=log_level)


@dataclass(frozen=True)
class HttpLimits:
    """How much the HTTP server holds: ``max_sessions`` MCP sessions in all (the SDK's
    limit), and per token ``max_sessions_per_token`` sessions and ``max_requests_per_token``
    requests in progress (429 past either, see ``mcp_gate``)."""

    max_sessions: int = 10_000
    max_sessions_per_token: int = DEFAULT_MAX_SESSIONS_PER_TOKEN
    max_requests_per_token: int = DEFAULT_MAX_REQUESTS_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_token", "max_requests_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")


def run_stdio(dex: DexMCPServer) -> None:
    """Serve over stdio (blocking), for the command line."""
    asyncio.run(serve_stdio(dex))


def serve(settings: DexSettings, *, http: bool = False, host: str = "127.0.0.1",
          port: int = 8765, session_id: str | None = None, approval_timeout: float = 60.0,
          call_timeout: float = 120.0, page_url: str | None = None,
          log_level: str = "warning", max_sessions: int = 10_000,
          max_sessions_per_token: int = DEFAULT_MAX_SESSIONS_PER_TOKEN,
          max_requests_per_token: int = DEFAULT_MAX_REQUESTS_PER_TOKEN) -> None:
    """What ``dex-tasks mcp`` runs (registered as the ``mcp`` entry point of the
    ``dex_tasks.servers`` group): the catalog over stdio, or over streamable HTTP behind the
    API's signed tokens (``call`` permission), until interrupted."""
    limits = HttpLimits(max_sessions, max_sessions_per_token, max_requests_per_token)
    secret = settings.signing_key() if http else None
    client = AsyncDexClient(settings)
    dex = DexMCPServer(client, session_id=session_id, approval_timeout=approval_timeout,
                       call_timeout=call_timeout, page_url=page_url)
    try:
        if secret is not None:
            serve_http(dex, secret, host=host, port=port, log_level=log_level, limits=limits)
        else:
            run_stdio(dex)
    finally:
        client.sync.close()
