"""Who may call the HTTP API: a signed token, checked before anything is read or changed.

The token travels as ``Authorization: Bearer <token>``. The pages a person opens from a link
(the session page, the sessions list) and the session page's event stream also accept it as a
``?token=`` query parameter: a link cannot carry a header, and the browser's ``EventSource``
cannot send one. A URL ends up in browser history and proxy logs, so every route a program calls
takes the header only; our own logs redact ``token=`` values (``dex_tasks.logs``) and pages are
served with ``Referrer-Policy: no-referrer`` so the link does not leak to other sites.

Failures map to HTTP as the design says: no token, a malformed, forged or expired one -> 401;
a genuine token for another session, or without the permission the route needs (``view`` to
read, ``operate`` to decide, an operator token to list every session) -> 403. Routes call these
functions first: nothing of the request body is read before that answer.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import HTTPException, status
from fastapi.security import APIKeyQuery, HTTPAuthorizationCredentials, HTTPBearer

from dex_tasks.errors import ForbiddenSessionError, InvalidTokenError
from dex_tasks.settings import DexSettings
from dex_tasks.tokens import TokenClaims, read_token

log = logging.getLogger(__name__)

# auto_error=False: we answer 401 ourselves, with a message and the WWW-Authenticate header.
bearer_scheme = HTTPBearer(
    auto_error=False,
    description="A token from `dex-tasks token SESSION_ID [--permission view|operate]`, or an "
    "operator token from `dex-tasks token --all-sessions`.",
)
query_token_scheme = APIKeyQuery(
    name="token",
    auto_error=False,
    description="The same token as a query parameter, only for the pages a person opens from "
    "a link and the session page's EventSource stream, which cannot send headers.",
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


def authenticate(secret: str, token: str) -> TokenClaims:
    """The claims of a genuine, unexpired token; 401 otherwise."""
    try:
        return read_token(secret, token)
    except InvalidTokenError as err:
        _refused("invalid", None)
        raise unauthorized(f"invalid token: {err}") from err


def authorize(claims: TokenClaims, session_id: str | None, permission: str) -> None:
    """403 unless ``claims`` grant ``permission`` on ``session_id`` (None: every session)."""
    try:
        claims.require(session_id, permission)
    except ForbiddenSessionError as err:
        _refused("forbidden", session_id)
        where = "every session" if session_id is None else f"session {session_id!r}"
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            detail=f"not allowed on {where}: {err}") from err


def check_token(secret: str, token: str, session_id: str | None, permission: str) -> TokenClaims:
    """Verify ``token`` grants ``permission`` on ``session_id``: the claims, or 401 / 403."""
    claims = authenticate(secret, token)
    authorize(claims, session_id, permission)
    return claims


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
