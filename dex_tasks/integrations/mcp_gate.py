"""The token gate in front of ``dex-tasks mcp --http``: who may call, as whom, how much.

Every HTTP request passes here before the MCP SDK reads a byte of it:

* **The token** (``Authorization: Bearer``, the API's signed tokens) must be genuine, unexpired
  and grant the ``call`` permission (``dex-tasks token SESSION --permission call``): none,
  forged or expired gets 401, a token without ``call`` (a person's ``view`` or ``operate``
  token) 403. ``call`` grants nothing on the API: the token an MCP client holds cannot decide
  the approvals of the calls its model makes. Its claims go to the handlers in the request's
  state.
* **The session is the token's.** The gate sets the request's user to an identity made from
  the token (a digest of it), which the SDK's session manager records when a session opens and
  compares on every later request: another token that learns an ``Mcp-Session-Id`` gets 404 for
  it, as if it did not exist, whether it posts, listens or DELETEs.
* **Per-token caps.** One token holder may keep at most ``max_sessions_per_token`` MCP sessions
  open and ``max_requests_per_token`` POST requests in progress at once (each ``tools/call``
  waiting for a person or its tool is one); past either cap the request gets 429 with
  ``Retry-After``, before the SDK sees it, so one holder cannot use up the server's session
  limit (``max_sessions``) or tie up its waits for everyone else.

A session counts as open from the answer that gave its id until it is deleted, answered 404,
or idle (no request in progress) for ``session_idle_timeout``, the timeout the SDK's session
manager is given too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from dex_tasks import ForbiddenSessionError, InvalidTokenError, TokenClaims, read_token
from dex_tasks.integrations.extras import needs_extra

with needs_extra("mcp", "dex_tasks.integrations.mcp_gate"):
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken

__all__ = [
    "CALL",
    "CLAIMS_STATE",
    "DEFAULT_MAX_REQUESTS_PER_TOKEN",
    "DEFAULT_MAX_SESSIONS_PER_TOKEN",
    "SESSION_IDLE_TIMEOUT",
    "TOKEN_STATE",
    "TokenGate",
    "token_principal",
]

CALL = "call"
"""The permission the gate asks for (``dex_tasks.tokens.CALL``)."""
CLAIMS_STATE = "dex_claims"
"""The request state entry holding the verified token's :class:`TokenClaims`."""
TOKEN_STATE = "dex_token"
"""The request state entry holding the presented token (to name its holder)."""
DEFAULT_MAX_SESSIONS_PER_TOKEN = 16
DEFAULT_MAX_REQUESTS_PER_TOKEN = 32
SESSION_IDLE_TIMEOUT = 30 * 60.0
"""Seconds without a request after which a session is closed (the SDK's default)."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def token_principal(token: str) -> str:
    """The identity a token's MCP sessions are bound to and its caps are counted under: a
    digest of the token (never the token itself)."""
    return "dex-token:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class _Session:
    in_flight: int = 0
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class _Holder:
    """What one token holds open: its sessions, its requests in progress."""

    sessions: dict[str, _Session] = field(default_factory=dict)
    opening: int = 0  # requests without a session id in progress: sessions about to open
    requests: int = 0

    def open_sessions(self, idle_timeout: float, now: float) -> int:
        for sid in [sid for sid, s in self.sessions.items()
                    if s.in_flight == 0 and now - s.last_seen >= idle_timeout]:
            del self.sessions[sid]  # closed by the SDK's idle timeout by now
        return len(self.sessions) + self.opening

    @property
    def idle(self) -> bool:
        return not (self.sessions or self.opening or self.requests)


class TokenGate:
    """ASGI middleware: a valid signed token with the ``call`` permission before anything of
    the request is read, the token's identity as the request's user (the SDK binds sessions to
    it), and the per-token caps (see the module's docstring)."""

    def __init__(self, app: ASGIApp, secret: str, *,
                 max_sessions_per_token: int = DEFAULT_MAX_SESSIONS_PER_TOKEN,
                 max_requests_per_token: int = DEFAULT_MAX_REQUESTS_PER_TOKEN,
                 session_idle_timeout: float = SESSION_IDLE_TIMEOUT) -> None:
        self.app = app
        self.secret = secret
        self.max_sessions_per_token = max_sessions_per_token
        self.max_requests_per_token = max_requests_per_token
        self.session_idle_timeout = session_idle_timeout
        self._holders: dict[str, _Holder] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        try:
            if scheme.lower() != "bearer" or not token:
                raise InvalidTokenError("no token given: send Authorization: Bearer <token>")
            claims = read_token(self.secret, token)
            if not claims.allows(CALL):
                raise ForbiddenSessionError(
                    "the token does not grant the 'call' permission: an MCP client's token is "
                    "minted with `dex-tasks token SESSION --permission call` (a person's "
                    "operate token decides approvals and is not for MCP clients)")
        except InvalidTokenError as err:
            await refuse(send, 401, str(err))
            return
        except ForbiddenSessionError as err:
            await refuse(send, 403, str(err))
            return
        principal = token_principal(token)
        state = scope.setdefault("state", {})
        state[CLAIMS_STATE] = claims
        state[TOKEN_STATE] = token
        scope["user"] = _user(principal, claims)
        await self._admit(scope, receive, send, principal)

    async def _admit(self, scope: Scope, receive: Receive, send: Send, principal: str) -> None:
        holder = self._holders.setdefault(principal, _Holder())
        headers = dict(scope.get("headers") or [])
        sid = headers.get(b"mcp-session-id", b"").decode("latin-1") or None
        method = scope.get("method", "")
        now = time.monotonic()
        # Decided before any await: concurrent requests of one token see each other's counts.
        if method == "POST" and holder.requests >= self.max_requests_per_token:
            self._forget_if_idle(principal, holder)
            await refuse(send, 429, f"this token already has {holder.requests} requests in "
                                    f"progress (at most {self.max_requests_per_token}): wait "
                                    "for one to end", retry_after=1)
            return
        opening = sid is None and method == "POST"
        if opening and holder.open_sessions(self.session_idle_timeout, now) \
                >= self.max_sessions_per_token:
            self._forget_if_idle(principal, holder)
            await refuse(send, 429, f"this token already has {self.max_sessions_per_token} "
                                    "MCP sessions open (the most one token may hold): close "
                                    "one (DELETE) or reuse it", retry_after=5)
            return
        session = holder.sessions.get(sid) if sid is not None else None
        holder.requests += method == "POST"
        holder.opening += opening
        if session is not None:
            session.in_flight += 1
        status: list[int] = []

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                given = dict(message.get("headers") or []).get(b"mcp-session-id")
                if opening and given and message["status"] < 400:
                    # The SDK opened a session for this token: counted from now on.
                    holder.sessions.setdefault(given.decode("latin-1"), _Session())
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            holder.requests -= method == "POST"
            holder.opening -= opening
            if session is not None:
                session.in_flight -= 1
                session.last_seen = time.monotonic()
                code = status[0] if status else None
                if code == 404 or (method == "DELETE" and code is not None and code < 400):
                    holder.sessions.pop(sid or "", None)  # gone: deleted, or unknown now
            self._forget_if_idle(principal, holder)

    def _forget_if_idle(self, principal: str, holder: _Holder) -> None:
        if holder.idle and self._holders.get(principal) is holder:
            del self._holders[principal]


def _user(principal: str, claims: TokenClaims) -> Any:
    """The request's user as the SDK's session manager reads it: the token's identity."""
    return AuthenticatedUser(AccessToken(
        token=principal, client_id=principal, scopes=list(claims.permissions),
        expires_at=int(claims.expires_at), subject=claims.approver))


async def refuse(send: Send, status: int, text: str, *, retry_after: int | None = None) -> None:
    """Answer ``status`` with ``{"error": text}`` (a Bearer challenge with a 401)."""
    body = json.dumps({"error": text}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="dex-tasks"'))
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
