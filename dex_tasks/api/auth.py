"""Who may call the HTTP API: a signed session token, checked before anything is read or changed.

The token travels as ``Authorization: Bearer <token>``. Two routes also accept it as a
``?token=`` query parameter: the approval page (a person opens it from a link, and a link cannot
carry a header) and its event stream (the browser's ``EventSource`` cannot send headers). A URL
ends up in browser history and proxy logs, so every other route takes the header only; our own
logs redact ``token=`` values (``dex_tasks.logs``) and the page is served with
``Referrer-Policy: no-referrer`` so the link does not leak to other sites.

Failures map to HTTP as the design says: no token, a malformed, forged or expired one -> 401;
a valid token for another session -> 403. Nothing is read or changed before that answer.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import HTTPException, Request, status
from fastapi.security import APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer

from dex_tasks.errors import ForbiddenSessionError, InvalidTokenError
from dex_tasks.settings import DexSettings
from dex_tasks.tokens import TokenClaims, verify_token

log = logging.getLogger(__name__)

# auto_error=False: we answer 401 ourselves, with a message and the WWW-Authenticate header.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="A session token from `dex-tasks token SESSION_ID`.",
)
query_token_scheme = APIKeyQuery(
    name="token",
    auto_error=False,
    description="The same token as a query parameter, for the approval page and its "
    "EventSource stream, which cannot send headers.",
)

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="dex-tasks"'}


def unauthorized(detail: str) -> HTTPException:
    """A 401 with the Bearer challenge."""
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers=_CHALLENGE)


def pick_token(
    credentials: HTTPAuthorizationCredentials | None, query_token: str | None = None
) -> str:
    """The presented token (header first, then ``?token=``); 401 if there is none."""
    if credentials is not None and credentials.credentials:
        return credentials.credentials
    if query_token:
        return query_token
    _refused("missing", None)
    raise unauthorized("missing token: send 'Authorization: Bearer <token>' "
                       "(get one with `dex-tasks token SESSION_ID`)")


def check_token(secret: str, token: str, session_id: str) -> TokenClaims:
    """Verify ``token`` for ``session_id``: the claims, or 401 (bad token) / 403 (other session)."""
    try:
        return verify_token(secret, token, session_id)
    except ForbiddenSessionError as err:
        # A genuine token, but for another session or without the permission to operate it.
        _refused("forbidden", session_id)
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail=f"not allowed on session {session_id!r}: {err}",
        ) from err
    except InvalidTokenError as err:
        _refused("invalid", session_id)
        raise unauthorized(f"invalid token: {err}") from err


async def body_session_id(request: Request) -> str | None:
    """The body's ``session_id`` if the body is a JSON object with a non-empty string there.

    Lets the resolve route authenticate before it validates the body, so a caller without a
    valid token gets 401/403 whatever it sent. Starlette caches the body, so the route still
    reads it afterwards; anything malformed is left for validation to name (422).
    """
    try:
        body: Any = await request.json()
    except ValueError:
        return None
    value = body.get("session_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def check_metrics_token(settings: DexSettings,
                        credentials: HTTPAuthorizationCredentials | None) -> None:
    """401 unless the request carries ``DEX_METRICS_TOKEN`` as its bearer token.

    A static token rather than a signed one: Prometheus reads it from a file on every scrape
    and cannot renew an expiring token. With no token configured /metrics stays closed.
    """
    expected = settings.metrics_token.get_secret_value() if settings.metrics_token else ""
    given = credentials.credentials if credentials is not None else ""
    if not expected:
        _refused("metrics_disabled", None)
        raise unauthorized("/metrics needs a token: set DEX_METRICS_TOKEN on the API and send "
                           "it as 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        _refused("metrics_token" if given else "missing", None)
        raise unauthorized("invalid metrics token: send DEX_METRICS_TOKEN as "
                           "'Authorization: Bearer <token>'")


def _refused(reason: str, session_id: str | None) -> None:
    # Never log the token itself: the reason and the session are enough to investigate.
    log.warning("http request refused", extra={"action": "http_auth_refused",
                                               "reason": reason, "session_id": session_id})
