"""The FastAPI app: resolve approvals, read a session, stream its events, the session pages.

Routes (OpenAPI at ``/docs`` and ``/openapi.json``)::

    POST /interrupts/resolve                 approve or reject one pending call (the seeds' body)
    GET  /sessions                           sessions with approvals waiting (operator token)
    GET  /sessions/{session_id}              the session page (HTML; the token may be ?token=)
    GET  /sessions/{session_id}/snapshot     the session, paged: transcript, calls, interrupts, ...
    GET  /sessions/{session_id}/events       its transitions as Server-Sent Events
    GET  /sessions/{session_id}/approvals    the old page address: redirects, keeping ?token=
    GET  /healthz                            liveness and store reachability
    GET  /metrics                            Prometheus metrics (dex_tasks.broker.metrics)

Every session route needs a token for that session with the ``view`` permission; deciding needs
``operate``; the list of sessions needs an operator token (see ``dex_tasks.api.auth``). Each route
checks the token before it reads anything of the request body, and no body may pass 64 KiB
(``dex_tasks.api.limits``). Bad input gets 400 with an ``error`` text naming the field.

The app owns one :class:`~dex_tasks.agent.client.DexClient`, built from the settings it is given and
closed at shutdown; nothing below reads the environment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import (
    APIRouter,
    Depends,
    FastAPI,
    Header,
    HTTPException,
    Path,
    Query,
    Request,
    Security,
)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from sqlalchemy import text
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dex_tasks.agent.approvals import (
    UNKNOWN_INTERRUPT,
    WRONG_SESSION,
    ApproverPermissionError,
    SnapshotWindow,
    StaleApprovalError,
    session_snapshot,
)
from dex_tasks.agent.client import DexClient
from dex_tasks.api.auth import (
    authenticate,
    authorize,
    bearer_scheme,
    check_metrics_token,
    check_token,
    pick_token,
    query_token_scheme,
)
from dex_tasks.api.events import (
    MAX_CURSOR,
    StreamHub,
    StreamLimitError,
    event_response,
    event_stream,
    latest_event_id,
)
from dex_tasks.api.inbox import DEFAULT_LIMIT, MAX_LIMIT, pending_sessions, session_page_path
from dex_tasks.api.limits import MAX_BODY_BYTES, BodyLimit, BodyTooLargeError, too_large_response
from dex_tasks.api.openapi import (
    AUTH_401,
    AUTH_403,
    BODY_413,
    PAGE_400,
    RESOLVE_BODY,
    RESOLVE_RESPONSES,
    SESSION_RESPONSES,
    openapi_schema,
)
from dex_tasks.api.pages import Pages, prefers_html
from dex_tasks.api.schemas import (
    BodyError,
    ErrorResponse,
    HealthResponse,
    PendingSessions,
    ResolveResponse,
    SnapshotPage,
    ValidationErrorResponse,
    parse_resolve_body,
    validation_error_body,
)
from dex_tasks.broker.metrics import beat_state, metrics_redis, render_metrics, shown_runs
from dex_tasks.errors import InvalidArgumentError, StoreUnavailableError
from dex_tasks.limits import KEY_MAX
from dex_tasks.logs import redact_logger
from dex_tasks.settings import DexSettings
from dex_tasks.tokens import OPERATE, VIEW, TokenClaims, token_identity

log = logging.getLogger(__name__)

SessionId = Annotated[str, Path(min_length=1, max_length=200, description="The session id.")]
Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)]
QueryToken = Annotated[str | None, Security(query_token_scheme)]

DEFAULT_SNAPSHOT_LIMIT = 200
MAX_SNAPSHOT_LIMIT = 1000

@dataclass
class ApiState:
    """What the routes share: the app's one client, the signing key, stream tuning, pages."""

    client: DexClient
    secret: str
    streams: StreamHub
    heartbeat_seconds: float
    pages: Pages


def _state(request: Request) -> ApiState:
    state: ApiState = request.app.state.dex
    return state


# -- auth dependencies ----------------------------------------------------------------------


def view_claims(request: Request, session_id: SessionId, credentials: Bearer) -> TokenClaims:
    """A reader of a session, by ``Authorization: Bearer`` only."""
    return check_token(_state(request).secret, pick_token(credentials), session_id, VIEW)


def link_view_claims(request: Request, session_id: SessionId, credentials: Bearer,
                     token: QueryToken = None) -> tuple[TokenClaims, str]:
    """A reader by header or ``?token=`` (only for what a browser opens without headers),
    and the token they presented."""
    presented = pick_token(credentials, token)
    return check_token(_state(request).secret, presented, session_id, VIEW), presented


class PageRefusedError(Exception):
    """A 401/403 on a page a person opened: answered in HTML, saying what to ask for."""

    def __init__(self, err: HTTPException) -> None:
        super().__init__(str(err.detail))
        self.status_code = err.status_code
        self.headers = err.headers or {}


def page_view_claims(request: Request, session_id: SessionId, credentials: Bearer,
                     token: QueryToken = None) -> tuple[TokenClaims, str]:
    """The session page's reader (header or ``?token=``) and the token they presented."""
    try:
        presented = pick_token(credentials, token)
        return check_token(_state(request).secret, presented, session_id, VIEW), presented
    except HTTPException as err:
        raise PageRefusedError(err) from err


@dataclass(frozen=True)
class OperatorAccess:
    """An operator token's holder, the token they presented, and whether they want HTML."""

    claims: TokenClaims
    token: str
    html: bool


def operator_access(request: Request, credentials: Bearer,
                    token: QueryToken = None) -> OperatorAccess:
    """A caller with an operator token: a browser may pass it as ``?token=`` (it asked for
    HTML); a program sends the header."""
    html = prefers_html(request.headers.get("accept", ""))
    try:
        presented = pick_token(credentials, token if html else None)
        claims = check_token(_state(request).secret, presented, None, VIEW)
    except HTTPException as err:
        if html:
            raise PageRefusedError(err) from err
        raise
    return OperatorAccess(claims, presented, html)


# -- routes ---------------------------------------------------------------------------------

router = APIRouter()


@router.post("/interrupts/resolve", response_model=ResolveResponse,
             responses=RESOLVE_RESPONSES, openapi_extra=RESOLVE_BODY, tags=["approvals"])
async def resolve_interrupt(request: Request, credentials: Bearer) -> Response:
    """Approve or reject one pending call: the seeds' route.

    Body: ``{"interrupt_id": str, "approved": bool, "rejection_message": str | null}``; the
    session is the token's (an optional ``session_id`` must equal it). The first decision wins;
    later ones get ``accepted: false`` and change nothing, so a client may retry freely. The
    decision is recorded with the approver named in the token, never one named in the body.

    Order: the token (401), its ``operate`` permission (403), then the body (413 past 64 KiB,
    400 naming what is wrong), then the body's session against the token's (403).
    """
    state = _state(request)
    # Nothing of the body has been read yet: a caller without a valid operate token is
    # answered from the headers alone, whatever it sends.
    presented = pick_token(credentials)
    claims = authenticate(state.secret, presented)
    # The token's own scope (its session, or every session for an operator token): this
    # checks the permission alone, with the reason in the 403.
    authorize(claims, claims.session_id, OPERATE)
    try:
        body = parse_resolve_body(await request.body())
    except BodyError as err:
        return JSONResponse({"error": str(err)}, status_code=400)
    if body.session_id is not None:
        authorize(claims, body.session_id, OPERATE)
    session_id = body.session_id or claims.session_id
    if session_id is None:
        return JSONResponse({"error": "session_id is required with an operator "
                                      "(all-sessions) token, which names no session"},
                            status_code=400)
    try:
        accepted = await run_in_threadpool(
            state.client.resolve_interrupt, session_id, body.interrupt_id, body.approved,
            rejection_message=body.rejection_message, approver=claims.approver,
            arguments=body.arguments, permissions=claims.permissions,
            arguments_version=body.arguments_version,
            identity=token_identity(presented, claims),
        )
    except ApproverPermissionError as err:
        raise HTTPException(403, detail=f"not allowed: {err}") from err
    except StaleApprovalError as err:
        return JSONResponse({"error": str(err)}, status_code=409)
    log.info("interrupt resolve requested", extra={
        "action": "http_interrupt_resolve", "session_id": session_id,
        "interrupt_id": body.interrupt_id, "approved": body.approved,
        "accepted": accepted, "approver": claims.approver,
    })
    reason = None
    if not accepted:
        reason = await run_in_threadpool(state.client.why_not_resolved, session_id,
                                         body.interrupt_id)
        # Whether an interrupt id exists in another session is not this token's to learn.
        reason = UNKNOWN_INTERRUPT if reason == WRONG_SESSION else reason
    return JSONResponse(ResolveResponse(accepted=accepted, reason=reason)
                        .model_dump(exclude_none=True))


@router.get(
    "/sessions",
    response_model=PendingSessions,
    responses={**SESSION_RESPONSES,
               200: {"description": "JSON for programs; HTML (links to each session page, "
                                    "carrying the token) when the client prefers text/html, "
                                    "as a browser does.",
                     "content": {"text/html": {}}},
               403: {**AUTH_403, "description": "A session token: the list needs an operator "
                                            "token (`dex-tasks token --all-sessions`)."}},
    tags=["sessions"],
)
def list_sessions(
    request: Request,
    access: Annotated[OperatorAccess, Depends(operator_access)],
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT,
                                description="At most this many sessions.")] = DEFAULT_LIMIT,
) -> Response:
    """The sessions with approvals waiting, newest request first (an operator's inbox).

    Needs an operator token (``dex-tasks token --all-sessions``). A browser gets a page and may
    pass the token as ``?token=``; a program gets JSON and sends the token as a header."""
    state = _state(request)
    listing = pending_sessions(state.client.store, limit)
    if access.html:
        return state.pages.sessions_page(request, listing, access.claims, access.token)
    return JSONResponse(listing.model_dump(mode="json"), headers={"Cache-Control": "no-store"})


@router.get("/sessions/{session_id}", response_class=HTMLResponse,
            responses={401: {"description": AUTH_401["description"], "content": {"text/html": {}}},
                       403: {"description": AUTH_403["description"], "content": {"text/html": {}}},
                       400: PAGE_400, 413: BODY_413},
            tags=["sessions"])
async def session_page(
    request: Request,
    session_id: SessionId,
    reader: Annotated[tuple[TokenClaims, str], Depends(page_view_claims)],
) -> HTMLResponse:
    """The session page for a person (what the seeds call the "Agent session" tab): the
    transcript, the approvals waiting, the decided ones, live. Open it with ``?token=<token>``
    (a link cannot carry a header). A token without ``operate`` sees it read-only."""
    claims, presented = reader
    state = _state(request)
    beat = await run_in_threadpool(beat_state, state.client.settings)
    return state.pages.session_page(request, session_id, claims, presented,
                                    beat_late=beat == "late")


@router.get("/sessions/{session_id}/snapshot", response_model=SnapshotPage,
            responses=SESSION_RESPONSES, tags=["sessions"])
def snapshot(
    request: Request,
    session_id: SessionId,
    _claims: Annotated[TokenClaims, Depends(view_claims)],
    limit: Annotated[int, Query(ge=1, le=MAX_SNAPSHOT_LIMIT, description=(
        "At most this many items in each list."))] = DEFAULT_SNAPSHOT_LIMIT,
    messages_after: Annotated[int, Query(ge=0, le=MAX_CURSOR, description=(
        "Only messages with a larger id (the last one you have), oldest first."))] = 0,
    messages_before: Annotated[int | None, Query(ge=1, le=MAX_CURSOR, description=(
        "Only messages with a smaller id: the newest `limit` of them, returned oldest first "
        f"(`{MAX_CURSOR}` for the transcript's tail)."))] = None,
    calls_after: Annotated[str | None, Query(min_length=1, max_length=KEY_MAX, description=(
        "Only calls after this one (its key) in the calls' order."))] = None,
    open_calls: Annotated[bool, Query(description=(
        "Only calls that have not ended."))] = False,
) -> JSONResponse:
    """A bounded part of the session: its transcript, tool calls, pending interrupts and
    decisions, at most ``limit`` (default 200, at most 1000) of each, read in one consistent
    transaction. Page on with ``messages_after`` / ``calls_after``.

    ``X-Server-Time`` (epoch seconds) lets the page count deadlines down on the server's clock
    rather than the browser's."""
    store = _state(request).client.store
    # Read before the snapshot: an event stored in between is sent again, never lost.
    cursor = latest_event_id(store, session_id)
    # One more of each than asked: tells whether there is more.
    window = SnapshotWindow(limit=limit + 1, messages_after=messages_after,
                            messages_before=messages_before, calls_after=calls_after,
                            open_calls=open_calls)
    snap = session_snapshot(store, session_id, window=window,
                            runs=shown_runs(_state(request).client.settings))
    tail = messages_before is not None
    messages = snap.messages[-limit:] if tail else snap.messages[:limit]
    page = SnapshotPage(
        session_id=session_id, limit=limit, event_cursor=cursor,
        beat=beat_state(_state(request).client.settings),
        messages=messages, messages_more=len(snap.messages) > limit,
        tool_calls=snap.tool_calls[:limit], calls_more=len(snap.tool_calls) > limit,
        pending_interrupts=snap.pending_interrupts[:limit],
        pending_more=len(snap.pending_interrupts) > limit,
        decided=snap.decided[-limit:], decided_more=len(snap.decided) > limit,
    )
    return JSONResponse(page.model_dump(mode="json"),
                        headers={"X-Server-Time": f"{time.time():.3f}",
                                 "Cache-Control": "no-store"})


@router.get(
    "/sessions/{session_id}/events",
    responses={**SESSION_RESPONSES,
               400: {"description": "A bad parameter: `after` or `Last-Event-ID` not an "
                                    "integer from 0 to 2^63-1, or a bad session id (`error` "
                                    "names which).",
                     "model": ValidationErrorResponse},
               429: {"description": "Too many streams open: on this server "
                                    "(DEX_MAX_EVENT_STREAMS) or with this token "
                                    "(DEX_MAX_EVENT_STREAMS_PER_TOKEN); `error` names which. "
                                    "See Retry-After.",
                     "model": ErrorResponse},
               200: {"description": "Server-Sent Events: `id:` the cursor, `event:` the event "
                                    "name, `data:` the event as JSON.",
                     "content": {"text/event-stream": {}}}},
    response_class=EventSourceResponse,
    tags=["sessions"],
)
async def events(
    request: Request,
    session_id: SessionId,
    reader: Annotated[tuple[TokenClaims, str], Depends(link_view_claims)],
    after: Annotated[int | None, Query(
        ge=0, le=MAX_CURSOR, description="Send events after this cursor (an event id).",
    )] = None,
    last_event_id: Annotated[int | None, Header(
        alias="Last-Event-ID", ge=0, le=MAX_CURSOR,
        description="Sent by a reconnecting EventSource; wins over `after` when later.",
    )] = None,
) -> Response:
    """The session's transitions, live, as Server-Sent Events; resumable by cursor.

    Accepts ``?token=`` because the browser's EventSource cannot send headers. Cursors are
    checked before the stream starts, so a bad one gets 400, never a stream that aborts. A
    stream past the server's or the token's limit gets 429 naming the limit; a stream ends
    (after a ``token_expired`` event) when its token expires."""
    claims, token = reader
    start = max(after or 0, last_event_id or 0)
    state = _state(request)
    try:
        slot = state.streams.reserve(token)
    except StreamLimitError as err:
        log.warning("event stream refused", extra={"action": "event_stream_refused",
                                                   "session_id": session_id, "error": str(err)})
        return JSONResponse({"error": str(err)}, status_code=429, headers={"Retry-After": "5"})
    return event_response(
        event_stream(state.client, session_id, start, slot=slot,
                     expires_at=claims.expires_at, heartbeat_seconds=state.heartbeat_seconds),
        heartbeat_seconds=state.heartbeat_seconds)


@router.get("/sessions/{session_id}/approvals", status_code=308, response_class=Response,
            responses={308: {"description": "To `/sessions/{session_id}`, query kept."},
                       400: PAGE_400, 413: BODY_413},
            tags=["sessions"])
def approvals_page(request: Request, session_id: SessionId) -> RedirectResponse:
    """The approval page's old address: links already handed out keep working (the page they
    reach checks their token)."""
    target = session_page_path(session_id)
    query = request.url.query
    return RedirectResponse(f"{target}?{query}" if query else target, status_code=308,
                            headers={"Referrer-Policy": "no-referrer"})


@router.get("/healthz", tags=["operations"], responses={
    503: {"description": "The store or Redis does not answer: a JSON object whose error says "
                         "which."}})
def healthz(request: Request) -> JSONResponse:
    """200 while the process runs and the store and Redis answer; 503 when either does not.

    ``beat`` says whether a sweep ran within the last 3 sweep intervals (``late``: no beat is
    running, so approval deadlines are not enforced and lost calls are not recovered). A late
    beat does not fail this check: restarting the API would not bring beat back.
    """
    state = _state(request)
    settings = state.client.settings
    with state.client.store.read() as conn:
        conn.execute(text("SELECT 1"))
    beat = beat_state(settings)
    if beat == "unknown":
        body = HealthResponse(status="unavailable", store="ok", redis="unreachable",
                              beat="unknown", event_streams=state.streams.open,
                              error="Redis does not answer")
        return JSONResponse(body.model_dump(exclude_none=True), status_code=503)
    body = HealthResponse(status="ok", store="ok", redis="ok", beat=beat,
                          event_streams=state.streams.open)
    return JSONResponse(body.model_dump(exclude_none=True))


@router.get("/metrics", tags=["operations"], response_class=Response,
            responses={401: {"description": "No token, or not DEX_METRICS_TOKEN."}})
def metrics(request: Request, credentials: Bearer) -> Response:
    """Prometheus metrics, computed from the store and Redis at scrape time. Needs
    ``Authorization: Bearer <DEX_METRICS_TOKEN>`` (Prometheus: ``authorization:
    credentials_file``): tool names and call volumes are business data."""
    client = _state(request).client
    check_metrics_token(client.settings, credentials)
    body, content_type = render_metrics(client.store, metrics_redis(client.settings))
    return Response(body, media_type=content_type)


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/docs")


_PAGE_ENDPOINTS = {session_page, approvals_page}


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    body = validation_error_body(exc)
    cursors = [str(e["loc"][-1]) for e in exc.errors()
               if tuple(e.get("loc", ()))[-1:] in (("after",), ("Last-Event-ID",))]
    if cursors:
        # The seeds' reading of a cursor: one line naming it and the range the store can hold.
        body["error"] = f"{cursors[0]} must be an integer from 0 to {MAX_CURSOR}"
    if request.scope.get("endpoint") in _PAGE_ENDPOINTS:
        # A link a person opened: say so in HTML, as its 401 and 403 do.
        return _state(request).pages.error_page(request, 400, body["error"], {})
    return JSONResponse(body, status_code=400)


async def _invalid_argument(_: Request, exc: Exception) -> JSONResponse:
    # The library's own checks (they name the field), for anything the route let through.
    return JSONResponse({"error": f"invalid request: {exc}"}, status_code=400)


async def _page_refused(request: Request, exc: Exception) -> HTMLResponse:
    # A person reads this, not a program: say what to do, in HTML.
    assert isinstance(exc, PageRefusedError)
    return _state(request).pages.error_page(request, exc.status_code, str(exc), exc.headers)


async def _too_large(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, BodyTooLargeError)
    return too_large_response(exc.limit)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    # One shape on every status: ``error`` always says what is wrong (as the 400s and 413s
    # do); ``detail``, FastAPI's own key, keeps the same text for clients written against it.
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse({"error": str(exc.detail), "detail": exc.detail},
                        status_code=exc.status_code, headers=exc.headers)


async def _store_down(_: Request, exc: Exception) -> JSONResponse:
    log.error("store unavailable", extra={"action": "http_store_unavailable", "error": str(exc)})
    text = "the store is unavailable, try again"
    return JSONResponse({"error": text, "detail": text}, status_code=503,
                        headers={"Retry-After": "1"})


def create_api(
    settings: DexSettings,
    *,
    event_poll_seconds: float = 0.25,
    heartbeat_seconds: float = 15.0,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The HTTP API for ``settings``'s store, broker and signing key.

    ``event_poll_seconds`` is how often the process looks for sessions with new events (one
    store read for all its open streams, see ``dex_tasks.api.events``); ``heartbeat_seconds``
    how long a stream may stay silent before a keep-alive comment (and how often an idle
    stream reads its session by itself); ``max_body_bytes`` the largest request body any route
    accepts. The stream limits are ``settings.max_event_streams`` and
    ``settings.max_event_streams_per_token``.
    """
    secret = settings.signing_key()  # first: no API at all without a real signing key
    # Page links carry ?token=: uvicorn's access log must never show it, however the app is
    # served (`dex-tasks api`, or `uvicorn --factory ...` with uvicorn's own log formatters).
    redact_logger("uvicorn.access")
    client = DexClient(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        client.close()

    api = FastAPI(
        title="dex-tasks",
        version="0.1.0",
        summary="Approve AI agents' tool calls and follow their sessions.",
        lifespan=lifespan,
    )
    api.state.dex = ApiState(
        client=client,
        secret=secret,
        streams=StreamHub(client.store, poll_seconds=event_poll_seconds,
                          max_streams=settings.max_event_streams,
                          max_per_token=settings.max_event_streams_per_token),
        heartbeat_seconds=heartbeat_seconds,
        pages=Pages(),
    )
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(RequestValidationError, _invalid_request)
    api.add_exception_handler(InvalidArgumentError, _invalid_argument)
    api.add_exception_handler(BodyTooLargeError, _too_large)
    api.add_exception_handler(PageRefusedError, _page_refused)
    api.add_exception_handler(StoreUnavailableError, _store_down)
    api.add_middleware(BodyLimit, limit=max_body_bytes)
    api.include_router(router)
    api.mount("/static", StaticFiles(packages=[("dex_tasks.api", "static")]), name="static")
    api.openapi = lambda: openapi_schema(api)  # type: ignore[method-assign]
    return api


def serve(settings: DexSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the API under uvicorn until SIGINT/SIGTERM (what ``dex-tasks api`` does).

    Logging is left to the caller's handlers (``log_config=None``), so access lines go through
    ``dex_tasks.logs`` and the ``?token=`` of page links is redacted.
    """
    import uvicorn

    api = create_api(settings)
    streams: StreamHub = api.state.dex.streams

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Open event streams never end by themselves: end them now so the shutdown does
            # not wait for its timeout (kept as a backstop).
            streams.shut_down()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(api, host=host, port=port, log_config=None, log_level=log_level,
                            timeout_graceful_shutdown=5)
    _Server(config).run()


def from_env() -> FastAPI:
    """``uvicorn --factory dex_tasks.api.app:from_env``: the API configured from ``DEX_*``."""
    return create_api(DexSettings())
