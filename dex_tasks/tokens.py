"""Signed approval tokens: who may decide a session's approvals, until when.

A token is an ``itsdangerous`` signed payload (HMAC-SHA1 over a key derived from
``DEX_SECRET_KEY`` and a salt of its own, so a signature made for another purpose never passes)
carrying the session id, the permissions, the approver's name and an absolute expiry. The
signature check is constant time (itsdangerous uses ``hmac.compare_digest``), and so is the
session comparison here.

Failures split the way HTTP needs them: :class:`InvalidTokenError` (missing, malformed, forged,
expired: "who are you?", 401) and :class:`ForbiddenSessionError` (a genuine token for another
session or without the ``operate`` permission: "not you", 403).
"""

from __future__ import annotations

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

__all__ = [
    "OPERATE",
    "ForbiddenSessionError",
    "InvalidTokenError",
    "TokenClaims",
    "issue_token",
    "verify_token",
]

OPERATE = "operate"
"""The permission to read a session's snapshot and decide its approvals."""

_SALT = "dex-tasks.session-token.v1"
MAX_APPROVER_LENGTH = 200


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says: its session, who holds it, what they may do, until when."""

    session_id: str
    approver: str | None
    permissions: tuple[str, ...]
    expires_at: float


def _serializer(secret: str) -> URLSafeSerializer:
    if not isinstance(secret, str) or not secret:
        raise ConfigurationError("DEX_SECRET_KEY is empty: set it to sign approval tokens")
    return URLSafeSerializer(secret, salt=_SALT)


def issue_token(
    secret: str,
    session_id: str,
    ttl_seconds: float = 3600,
    approver: str | None = None,
    *,
    permissions: Sequence[str] = (OPERATE,),
    now: float | None = None,
) -> str:
    """A token that lets its holder operate ``session_id`` for ``ttl_seconds``.

    ``approver`` is the name recorded with each decision made with it.
    """
    if not isinstance(session_id, str) or not session_id:
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
    perms = [str(p) for p in permissions]
    now = time.time() if now is None else now
    payload: dict[str, Any] = {"sid": session_id, "perm": perms, "exp": now + ttl_seconds}
    if approver is not None:
        payload["apr"] = approver
    return str(_serializer(secret).dumps(payload))


def verify_token(secret: str, token: str, session_id: str, now: float | None = None) -> TokenClaims:
    """The claims of ``token`` if it lets its holder operate ``session_id`` now.

    Raises :class:`InvalidTokenError` for a missing, malformed, forged or expired token and
    :class:`ForbiddenSessionError` for a valid one bound to another session or lacking the
    ``operate`` permission.
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
    if not isinstance(session_id, str) or not hmac.compare_digest(
        claims.session_id.encode(), session_id.encode()
    ):
        raise ForbiddenSessionError("the token is for another session")
    if OPERATE not in claims.permissions:
        raise ForbiddenSessionError(f"the token does not grant the {OPERATE!r} permission")
    return claims


def _claims(payload: Any) -> TokenClaims:
    # A correctly signed payload was made by us, but check its shape anyway: a token issued by
    # a future version, or with the same secret and salt by other code, must not crash us.
    try:
        session_id = payload["sid"]
        expires_at = payload["exp"]
        permissions = payload["perm"]
        approver = payload.get("apr")
    except (TypeError, KeyError, AttributeError):
        raise InvalidTokenError("the token's payload has the wrong shape") from None
    if (not isinstance(session_id, str) or isinstance(expires_at, bool)
            or not isinstance(expires_at, int | float) or not isinstance(permissions, list)
            or not all(isinstance(p, str) for p in permissions)
            or not (approver is None or isinstance(approver, str))):
        raise InvalidTokenError("the token's payload has the wrong shape")
    return TokenClaims(session_id=session_id, approver=approver,
                       permissions=tuple(permissions), expires_at=float(expires_at))
