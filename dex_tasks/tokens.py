"""Signed approval tokens: who may read or decide a session's approvals, until when.

A token is an ``itsdangerous`` signed payload (HMAC-SHA1 over a key derived from
``DEX_SECRET_KEY`` and a salt of its own, so a signature made for another purpose never passes)
carrying its scope, the permissions, the approver's name and an absolute expiry. The signature is
checked before any claim is looked at, in constant time (itsdangerous uses
``hmac.compare_digest``), and so is the session comparison here.

Scope: a session token names one session (``sid``); an operator token (``dex-tasks token
--all-sessions``) carries a claim of its own (``all: true``) and no session id, so it is never
confused with a session's: no session id, whatever its text, makes a token cover every session.
A payload with both, or neither, is refused.

Permissions: :data:`VIEW` reads a session (snapshot, events, the page, read-only);
:data:`OPERATE` also decides its approvals (and implies :data:`VIEW`); :data:`CALL` calls tools
through ``dex-tasks mcp --http`` and nothing else: it neither reads the session nor decides, so
the token an MCP client (an agent) holds cannot approve the calls its model makes
(``dex-tasks token SESSION --permission call``). Tokens issued before
:data:`VIEW` existed carry ``["operate"]`` and keep working unchanged. A token may also carry
named permissions (``refunds.approve``), signed like the rest: a policy with
``approver_permission`` accepts approvals only from tokens holding it
(``dex-tasks token SESSION --grant refunds.approve``).

Failures split the way HTTP needs them: :class:`InvalidTokenError` (missing, malformed, forged,
expired: "who are you?", 401) and :class:`ForbiddenSessionError` (a genuine token for another
session or without the permission asked for: "not you", 403).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadData, URLSafeSerializer

from dex_tasks.errors import (
    ConfigurationError,
    ForbiddenSessionError,
    InvalidArgumentError,
    InvalidTokenError,
)
from dex_tasks.policy import check_permission_name

__all__ = [
    "CALL",
    "OPERATE",
    "PERMISSIONS",
    "VIEW",
    "ForbiddenSessionError",
    "InvalidTokenError",
    "TokenClaims",
    "issue_token",
    "read_token",
    "token_identity",
    "verify_token",
]

VIEW = "view"
"""The permission to read a session: its snapshot, its events, its page (read-only)."""

OPERATE = "operate"
"""The permission to read a session and decide its approvals."""

CALL = "call"
"""The permission to call tools through the MCP server; it grants nothing else."""

PERMISSIONS = (VIEW, OPERATE, CALL)
"""The permissions a token can be issued with."""

_SALT = "dex-tasks.session-token.v1"
MAX_APPROVER_LENGTH = 200


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says: its scope, who holds it, what they may do, until when.

    ``session_id`` is None exactly when ``all_sessions`` is true (an operator token).
    """

    session_id: str | None
    approver: str | None
    permissions: tuple[str, ...]
    expires_at: float
    all_sessions: bool = False

    def allows(self, permission: str) -> bool:
        """Whether the token grants ``permission`` (``operate`` implies ``view``)."""
        return permission in self.permissions or (
            permission == VIEW and OPERATE in self.permissions)

    def covers(self, session_id: str) -> bool:
        """Whether the token is valid for ``session_id`` (always, for an operator token)."""
        if self.all_sessions:
            return True
        # Constant time: a caller probing session ids learns nothing from the timing.
        return (isinstance(session_id, str) and self.session_id is not None
                and hmac.compare_digest(self.session_id.encode(), session_id.encode()))

    @property
    def strongest_permission(self) -> str | None:
        """``operate``, ``view`` or None: what the page says the holder works as."""
        for permission in (OPERATE, VIEW):
            if self.allows(permission):
                return permission
        return None

    def require(self, session_id: str | None, permission: str) -> None:
        """Raise :class:`ForbiddenSessionError` unless the token grants ``permission`` on
        ``session_id`` (None: on every session, which only an operator token does)."""
        if session_id is None:
            if not self.all_sessions:
                raise ForbiddenSessionError(
                    "the token is for one session; this needs an operator token "
                    "(dex-tasks token --all-sessions)")
        elif not self.covers(session_id):
            raise ForbiddenSessionError("the token is for another session")
        if not self.allows(permission):
            raise ForbiddenSessionError(f"the token does not grant the {permission!r} permission")


def token_identity(token: str, claims: TokenClaims) -> str:
    """Who holds ``token``, as the store records the caller of a call and compares deciders.

    The token's name (``--approver``) when it has one: every token minted with that name is the
    same person or program. Otherwise the token itself stands for its holder (a digest of it,
    never the token: ``token:`` and 24 hex digits).
    """
    if claims.approver:
        return claims.approver
    return "token:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _serializer(secret: str) -> URLSafeSerializer:
    if not isinstance(secret, str) or not secret:
        raise ConfigurationError("DEX_SECRET_KEY is empty: set it to sign approval tokens")
    return URLSafeSerializer(secret, salt=_SALT)


def issue_token(
    secret: str,
    session_id: str | None,
    ttl_seconds: float = 3600,
    approver: str | None = None,
    *,
    permissions: Sequence[str] = (OPERATE,),
    all_sessions: bool = False,
    now: float | None = None,
) -> str:
    """A token that grants ``permissions`` on ``session_id`` for ``ttl_seconds``.

    With ``all_sessions=True`` (and ``session_id`` None) it is an operator token, valid for
    every session. ``approver`` is the name recorded with each decision made with it.
    """
    if all_sessions:
        if session_id is not None:
            raise InvalidArgumentError(
                f"session_id must be None for an all-sessions token, got {session_id!r}")
    elif not isinstance(session_id, str) or not session_id:
        raise InvalidArgumentError(f"session_id must be a non-empty string, got {session_id!r}")
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int | float) \
            or not math.isfinite(ttl_seconds) or ttl_seconds <= 0:
        raise InvalidArgumentError(f"ttl_seconds must be a positive number, got {ttl_seconds!r}")
    if approver is not None and (not isinstance(approver, str)
                                 or not 0 < len(approver) <= MAX_APPROVER_LENGTH):
        raise InvalidArgumentError(
            f"approver must be a string of 1 to {MAX_APPROVER_LENGTH} characters, "
            f"got {approver!r}"
        )
    if isinstance(permissions, str):
        raise InvalidArgumentError(
            f"permissions must be a list of {' / '.join(PERMISSIONS)} or named permissions, "
            f"got {permissions!r}")
    for p in permissions:
        if p not in PERMISSIONS:
            check_permission_name(p, "permissions", InvalidArgumentError)
    now = time.time() if now is None else now
    # The payload of a session token is exactly what earlier releases issued, so tokens
    # already handed out stay valid and new session tokens verify on an older API too.
    scope: dict[str, Any] = {"all": True} if all_sessions else {"sid": session_id}
    payload: dict[str, Any] = {**scope, "perm": list(permissions), "exp": now + ttl_seconds}
    if approver is not None:
        payload["apr"] = approver
    return str(_serializer(secret).dumps(payload))


def read_token(secret: str, token: str, now: float | None = None) -> TokenClaims:
    """The claims of a genuine, unexpired ``token``, whatever its scope and permissions.

    Raises :class:`InvalidTokenError` for a missing, malformed, forged or expired token. The
    signature is checked first: nothing of an unsigned payload is ever read.
    """
    serializer = _serializer(secret)
    if not isinstance(token, str) or not token:
        raise InvalidTokenError("no token given")
    try:
        payload = serializer.loads(token)
    except BadData:
        # Forged, tampered with, truncated or not a token at all: the reason stays vague on
        # purpose, a guesser learns nothing from it.
        raise InvalidTokenError("the token is invalid (bad signature or format)") from None
    claims = _claims(payload)
    now = time.time() if now is None else now
    if now >= claims.expires_at:
        raise InvalidTokenError("the token has expired")
    return claims


def verify_token(
    secret: str,
    token: str,
    session_id: str | None,
    now: float | None = None,
    *,
    permission: str = OPERATE,
) -> TokenClaims:
    """The claims of ``token`` if it grants ``permission`` on ``session_id`` now.

    ``session_id=None`` asks for every session: only an operator token passes. Raises
    :class:`InvalidTokenError` for a missing, malformed, forged or expired token and
    :class:`ForbiddenSessionError` for a genuine one bound to another session or lacking the
    permission.
    """
    claims = read_token(secret, token, now)
    claims.require(session_id, permission)
    return claims


def _claims(payload: Any) -> TokenClaims:
    # A correctly signed payload was made by us, but check its shape anyway: a token issued by
    # a future version, or with the same secret and salt by other code, must not crash us.
    if not isinstance(payload, dict):
        raise InvalidTokenError("the token's payload has the wrong shape")
    session_id = payload.get("sid")
    all_sessions = payload.get("all", False)
    expires_at = payload.get("exp")
    permissions = payload.get("perm")
    approver = payload.get("apr")
    # Exactly one scope: a session id, or the operator claim (true, the JSON boolean).
    scoped = (isinstance(session_id, str) and "all" not in payload) or (
        all_sessions is True and "sid" not in payload)
    if (not scoped or isinstance(expires_at, bool)
            or not isinstance(expires_at, int | float) or not math.isfinite(expires_at)
            or not isinstance(permissions, list)
            or not all(isinstance(p, str) for p in permissions)
            or not (approver is None or isinstance(approver, str))):
        raise InvalidTokenError("the token's payload has the wrong shape")
    return TokenClaims(session_id=None if all_sessions else session_id, approver=approver,
                       permissions=tuple(permissions), expires_at=float(expires_at),
                       all_sessions=all_sessions is True)
