"""Request body limits for every route: refused before they are read, never buffered whole.

:class:`BodyLimit` wraps the whole app. A request whose ``Content-Length`` is over the limit
gets 413 at once: the app never runs, so no route can read or parse it, and the client (which
sent ``Expect: 100-continue`` or simply waits for our answer) need not even send it. A chunked
body has no declared length: its bytes are counted as a route reads them, and the read that
passes the limit raises :class:`BodyTooLargeError` (answered 413), so at most ``limit`` bytes
plus one chunk are ever held.

Routes read nothing before they have checked the caller's token (``dex_tasks.api.auth``); this
module bounds what they read afterwards.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
"""The largest request body any route accepts (a decision is a few hundred bytes)."""


class BodyTooLargeError(Exception):
    """A streamed request body passed the limit while a route read it (answered 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


def too_large_response(limit: int) -> JSONResponse:
    """The 413 answer. The connection is closed: the rest of the body is never read."""
    return JSONResponse({"error": f"the request body is larger than {limit} bytes"},
                        status_code=413, headers={"Connection": "close"})


class BodyLimit:
    """ASGI middleware: every request body at most ``limit`` bytes."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await JSONResponse(
                {"error": "Content-Length must be a non-negative integer"}, status_code=400,
                headers={"Connection": "close"})(scope, receive, send)
            return
        if declared is not None and declared > self.limit:
            log.warning("request body too large", extra={
                "action": "http_body_too_large", "path": scope.get("path"),
                "content_length": declared})
            await too_large_response(self.limit)(scope, receive, send)
            return
        received = 0
        limit = self.limit

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    log.warning("request body too large", extra={
                        "action": "http_body_too_large", "path": scope.get("path"),
                        "received": received})
                    raise BodyTooLargeError(limit)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None if not declared, -1 if not a valid number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not (text.isascii() and text.isdigit()):
                return -1
            # Past 18 digits it is over any limit; int() of thousands of digits is refused.
            return int(text) if len(text) <= 18 else 10**18
    return None
