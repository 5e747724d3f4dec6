"""The FastAPI app: resolve approvals, read a session, stream its events, the approval page.

Routes (OpenAPI at ``/docs`` and ``/openapi.json``)::

    POST /interrupts/resolve                 approve or reject one pending call
    GET  /sessions/{session_id}/snapshot     the session: calls, messages, interrupts, decisions
    GET  /sessions/{session_id}/events       its transitions as Server-Sent Events
    GET  /sessions/{session_id}/approvals    the approval page (HTML; the token may be ?token=)
    GET  /healthz                            liveness and store reachability
    GET  /metrics                            Prometheus metrics (dex_tasks.metrics)

Every session route needs a token signed for that session (see ``dex_tasks.api.auth``). The app
owns one :class:`~dex_tasks.client.DexClient`, built from the settings it is given and closed at
shutdown; nothing below reads the environment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
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
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from sqlalchemy import text

from dex_tasks.api.auth import (
    bearer_scheme,
    body_session_id,
    check_metrics_token,
    check_token,
    pick_token,
    query_token_scheme,
    unauthorized,
)
from dex_tasks.api.events import StreamCounter, event_stream
from dex_tasks.api.schemas import (
    HealthResponse,
    ResolveRequest,
    ResolveResponse,
    ValidationErrorResponse,
    validation_error_body,
)
from dex_tasks.client import DexClient
from dex_tasks.errors import InvalidArgumentError, StoreUnavailableError
from dex_tasks.metrics import metrics_redis, render_metrics
from dex_tasks.records import AgentSnapshot
from dex_tasks.settings import DexSettings
from dex_tasks.tokens import TokenClaims

log = logging.getLogger(__name__)

SessionId = Annotated[str, Path(min_length=1, max_length=200, description="The session id.")]
Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)]
QueryToken = Annotated[str | None, Security(query_token_scheme)]

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "No token, or a malformed, forged or expired one."},
    403: {"description": "A valid token for another session."},
    422: {"description": "The request has the wrong shape; `message` names the field.",
          "model": ValidationErrorResponse},
}

# The page loads only our own script and stylesheet and talks only to this origin, so tool
# arguments rendered into it can never pull in or run anything else.
_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
}


@dataclass
class ApiState:
    """What the routes share: the app's one client, the signing key, stream tuning."""

    client: DexClient
    secret: str
    streams: StreamCounter
    event_poll_seconds: float
    heartbeat_seconds: float
    page_html: str


def _state(request: Request) -> ApiState:
    state: ApiState = request.app.state.dex
    return state


# -- auth dependencies ----------------------------------------------------------------------


async def resolve_claims(request: Request, credentials: Bearer) -> TokenClaims | None:
    """The resolve route's caller: checked against the body's session_id, before validation."""
    # A caller without a valid token gets 401/403 whatever body it sent.
    token = pick_token(credentials)
    session_id = await body_session_id(request)
    if session_id is None:
        return None  # the body is malformed: validation answers 422 naming the field
    return check_token(_state(request).secret, token, session_id)


def header_claims(request: Request, session_id: SessionId, credentials: Bearer) -> TokenClaims:
    """A caller of a session route, by ``Authorization: Bearer`` only."""
    return check_token(_state(request).secret, pick_token(credentials), session_id)


def link_claims(request: Request, session_id: SessionId, credentials: Bearer,
                token: QueryToken = None) -> TokenClaims:
    """A caller by header or ``?token=``: only for what a browser opens without headers."""
    return check_token(_state(request).secret, pick_token(credentials, token), session_id)


# -- routes ---------------------------------------------------------------------------------

router = APIRouter()


@router.post("/interrupts/resolve", responses=_AUTH_RESPONSES, tags=["approvals"])
def resolve_interrupt(
    request: Request,
    body: ResolveRequest,
    claims: Annotated[TokenClaims | None, Depends(resolve_claims)],
) -> ResolveResponse:
    """Approve or reject one pending call. The first decision wins; later ones get
    ``accepted: false`` and change nothing, so a client may retry freely. The decision is
    recorded with the approver named in the token."""
    if claims is None:  # unreachable: a body without session_id fails validation first
        raise unauthorized("the token could not be checked against the body's session_id")
    accepted = _state(request).client.resolve_interrupt(
        body.session_id,
        body.interrupt_id,
        body.approved,
        rejection_message=body.rejection_message,
        approver=claims.approver,
    )
    log.info("interrupt resolve requested", extra={
        "action": "http_interrupt_resolve", "session_id": body.session_id,
        "interrupt_id": body.interrupt_id, "approved": body.approved,
        "accepted": accepted, "approver": claims.approver,
    })
    return ResolveResponse(accepted=accepted)


@router.get("/sessions/{session_id}/snapshot", response_model=AgentSnapshot,
            responses=_AUTH_RESPONSES, tags=["sessions"])
def snapshot(
    request: Request,
    session_id: SessionId,
    _claims: Annotated[TokenClaims, Depends(header_claims)],
) -> JSONResponse:
    """The session as it stands: tool calls, messages, pending interrupts and decisions.

    ``X-Server-Time`` (epoch seconds) lets the page count deadlines down on the server's clock
    rather than the browser's."""
    snap = _state(request).client.get_agent_snapshot(session_id)
    return JSONResponse(snap.model_dump(mode="json"),
                        headers={"X-Server-Time": f"{time.time():.3f}",
                                 "Cache-Control": "no-store"})


@router.get(
    "/sessions/{session_id}/events",
    responses={**_AUTH_RESPONSES,
               200: {"description": "Server-Sent Events: `id:` the cursor, `event:` the event "
                                    "name, `data:` the event as JSON.",
                     "content": {"text/event-stream": {}}}},
    response_class=StreamingResponse,
    tags=["sessions"],
)
async def events(
    request: Request,
    session_id: SessionId,
    _claims: Annotated[TokenClaims, Depends(link_claims)],
    after: Annotated[int, Query(ge=0, description="Send events after this cursor.")] = 0,
    last_event_id: Annotated[int | None, Header(
        alias="Last-Event-ID", ge=0,
        description="Sent by a reconnecting EventSource; wins over `after` when later.",
    )] = None,
) -> StreamingResponse:
    """The session's transitions, live, as Server-Sent Events; resumable by cursor.

    Accepts ``?token=`` because the browser's EventSource cannot send headers."""
    state = _state(request)
    start = max(after, last_event_id or 0)
    return StreamingResponse(
        event_stream(request, state.client, session_id, start, counter=state.streams,
                     poll_seconds=state.event_poll_seconds,
                     heartbeat_seconds=state.heartbeat_seconds),
        media_type="text/event-stream",
        # no-transform / X-Accel-Buffering: proxies must pass each event on at once.
        headers={"Cache-Control": "no-store, no-transform", "X-Accel-Buffering": "no"},
    )


@router.get("/sessions/{session_id}/approvals", response_class=HTMLResponse,
            responses=_AUTH_RESPONSES, tags=["approvals"])
def approval_page(
    request: Request, session_id: SessionId, credentials: Bearer, token: QueryToken = None,
) -> HTMLResponse:
    """The approval page for a person: open it with ``?token=<token>`` (a link cannot carry
    a header)."""
    state = _state(request)
    try:
        check_token(state.secret, pick_token(credentials, token), session_id)
    except HTTPException as err:
        # A person reads this, not a program: say what to do, in HTML.
        return HTMLResponse(_error_page(err), status_code=err.status_code,
                            headers={**_PAGE_HEADERS, **(err.headers or {})})
    return HTMLResponse(state.page_html, headers=_PAGE_HEADERS)


@router.get("/healthz", tags=["operations"])
def healthz(request: Request) -> HealthResponse:
    """200 while the process runs and the store answers; 503 when the store does not."""
    state = _state(request)
    with state.client.store.read() as conn:
        conn.execute(text("SELECT 1"))
    return HealthResponse(status="ok", store="ok", event_streams=state.streams.open)


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


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(validation_error_body(exc), status_code=422)


async def _invalid_argument(_: Request, exc: Exception) -> JSONResponse:
    # The library's own checks (they name the field), for anything the schema let through.
    return JSONResponse({"message": f"invalid request: {exc}", "detail": []}, status_code=422)


async def _store_down(_: Request, exc: Exception) -> JSONResponse:
    log.error("store unavailable", extra={"action": "http_store_unavailable", "error": str(exc)})
    return JSONResponse({"detail": "the store is unavailable, try again"}, status_code=503,
                        headers={"Retry-After": "1"})


def create_api(
    settings: DexSettings,
    *,
    event_poll_seconds: float = 0.25,
    heartbeat_seconds: float = 15.0,
) -> FastAPI:
    """The HTTP API for ``settings``'s store, broker and signing key.

    ``event_poll_seconds`` is how often an open event stream reads the store for new events;
    ``heartbeat_seconds`` how long a stream may stay silent before a keep-alive comment.
    """
    secret = settings.signing_key()  # first: no API at all without a real signing key
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
        streams=StreamCounter(),
        event_poll_seconds=event_poll_seconds,
        heartbeat_seconds=heartbeat_seconds,
        page_html=resources.files("dex_tasks.api").joinpath("approvals.html")
        .read_text("utf-8"),
    )
    api.add_exception_handler(RequestValidationError, _invalid_request)
    api.add_exception_handler(InvalidArgumentError, _invalid_argument)
    api.add_exception_handler(StoreUnavailableError, _store_down)
    api.include_router(router)
    api.mount("/static", StaticFiles(packages=[("dex_tasks.api", "static")]), name="static")
    return api


def serve(settings: DexSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the API under uvicorn until SIGINT/SIGTERM (what ``dex-tasks api`` does).

    Logging is left to the caller's handlers (``log_config=None``), so access lines go through
    ``dex_tasks.logs`` and the ``?token=`` of page links is redacted.
    """
    import uvicorn

    api = create_api(settings)
    streams: StreamCounter = api.state.dex.streams

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Open event streams never end by themselves: end them now so the shutdown does
            # not wait for its timeout (kept as a backstop).
            streams.closing = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(api, host=host, port=port, log_config=None, log_level=log_level,
                            timeout_graceful_shutdown=5)
    _Server(config).run()


def from_env() -> FastAPI:
    """``uvicorn --factory dex_tasks.api.app:from_env``: the API configured from ``DEX_*``."""
    return create_api(DexSettings())


def _error_page(err: HTTPException) -> str:
    import html

    title = "Not allowed" if err.status_code == 403 else "Sign-in link needed"
    return (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        f"<title>{title} - dex-tasks</title>"
        f"<h1>{title}</h1><p>{html.escape(str(err.detail))}</p>"
        "<p>Ask an operator for a fresh link: <code>dex-tasks token SESSION_ID</code> prints "
        "a token; open <code>/sessions/SESSION_ID/approvals?token=TOKEN</code>.</p></html>"
    )
