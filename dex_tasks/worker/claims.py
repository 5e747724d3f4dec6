"""Redis claims: the fast path in front of the store's claim of a single-attempt call.

A claim is ``SET dex:claim:<key> <owner> NX EX <ttl>``. It is not released while its call is in
the store: a key that ran is never run again. The store's compare-and-set stays the authority;
the claim only keeps duplicate deliveries from reaching the store at all. ``dex-tasks prune``
deletes the claims of the calls it deletes (:func:`forget`): their tombstones in the store
keep them from running again, and a claim costs Redis memory for its whole TTL.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

PREFIX = "dex:claim:"


def claim_key(idempotency_key: str) -> str:
    """The Redis key of a call's claim."""
    return PREFIX + idempotency_key


def try_claim(client: redis.Redis, idempotency_key: str, owner: str, ttl: int) -> bool:
    """Take the claim; True if this caller is the first ever to do so."""
    value = json.dumps({"owner": owner, "at": time.time()})
    return bool(client.set(claim_key(idempotency_key), value, nx=True, ex=ttl))


def read_claim(client: redis.Redis, idempotency_key: str) -> dict[str, Any] | None:
    """The claim's owner and time, or None when nobody has claimed the call."""
    raw = client.get(claim_key(idempotency_key))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return {"owner": "?", "at": 0.0}
    return data if isinstance(data, dict) else {"owner": "?", "at": 0.0}


def forget(client: redis.Redis, idempotency_keys: list[str]) -> int:
    """Delete the claims of pruned calls; returns how many existed."""
    if not idempotency_keys:
        return 0
    return int(client.delete(*(claim_key(key) for key in idempotency_keys)))
