"""Webhook signatures, shared by the workers that sign and the receivers that verify.

A delivery carries ``Dex-Signature: t=<unix seconds>,v1=<hex>``, where ``v1`` is HMAC-SHA256
with ``DEX_WEBHOOK_SECRET`` over ``f"{t}.".encode() + body`` (the raw bytes of the body), as
Stripe and GitHub sign theirs; and ``Dex-Event-Id``, the event's id (also the body's ``id``).
Deliveries are at least once: a receiver may get one event more than once (a worker lost
between the receiver's 2xx and the record of it, a republished delivery), always with the
same event id and body, so it keeps the ids it has handled and drops repeats.

Receiver side, five lines::

    from dex_tasks import verify_webhook
    event = verify_webhook(request.body, request.headers["Dex-Signature"], secret)
    if seen(event["id"]): return 200
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

from dex_tasks.errors import DexError

SIGNATURE_HEADER = "Dex-Signature"
EVENT_ID_HEADER = "Dex-Event-Id"
EVENT_HEADER = "Dex-Event"
DEFAULT_TOLERANCE = 300


class WebhookSignatureError(DexError):
    """A webhook's ``Dex-Signature`` is missing, malformed, does not match the body, or is older
    (or newer) than the tolerance: the request is not from dex-tasks, or is a replay."""


def signature(secret: str, body: bytes, timestamp: int) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp>." + body`` with ``secret``."""
    if not secret:
        raise WebhookSignatureError("the webhook secret is empty")
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, now: float | None = None) -> str:
    """The ``Dex-Signature`` header value for ``body`` signed now."""
    timestamp = int(time.time() if now is None else now)
    return f"t={timestamp},v1={signature(secret, body, timestamp)}"


def verify_webhook(body: bytes | str, header: str | None, secret: str,
                   tolerance: float = DEFAULT_TOLERANCE,
                   now: float | None = None) -> dict[str, Any]:
    """The event (the parsed body) if ``header`` is a valid ``Dex-Signature`` of ``body``.

    Raises :class:`WebhookSignatureError` when the header is missing or malformed, when no
    ``v1`` matches (compared in constant time), or when its timestamp is more than
    ``tolerance`` seconds from now (a replayed request).
    """
    raw = body.encode() if isinstance(body, str) else bytes(body)
    if not header:
        raise WebhookSignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t":
            try:
                timestamp = int(value)
            except ValueError:
                raise WebhookSignatureError(f"{SIGNATURE_HEADER}: t is not a unix time") \
                    from None
        elif name == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        raise WebhookSignatureError(f"{SIGNATURE_HEADER} must be t=<unix>,v1=<hex>")
    expected = signature(secret, raw, timestamp)
    # Every candidate is compared (several v1 during a secret rotation), each in constant time.
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(expected.encode(), candidate.encode())
    if not matched:
        raise WebhookSignatureError("the signature does not match the body")
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance:
        raise WebhookSignatureError(
            f"the signature is {abs(now - timestamp):.0f}s old, over the {tolerance:.0f}s "
            "tolerance (a replay?)")
    try:
        event: dict[str, Any] = json.loads(raw)
    except ValueError as err:
        raise WebhookSignatureError(f"the body is not JSON: {err}") from None
    return event
