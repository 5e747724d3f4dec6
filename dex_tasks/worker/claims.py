"""Redis claims: the fast path in front of the store's claim of a single-attempt call.

A claim is ``SET dex:claim:<key> <owner> NX EX <ttl>``. It is not released while its call is
open: a key that ran is never run again. The store's compare-and-set stays the authority; the
claim only keeps duplicate deliveries from reaching the store at all. So once the call has
ended (its ended record refuses any later claim by itself), the notifier that announces the end
cuts what is left of the claim's life to ``claim_ended_ttl_seconds`` (``broker/announce.py``):
Redis holds the claims of calls in flight and of the last minute's, not a month's (issue 30
item 4). ``dex-tasks prune`` deletes the claims of the calls it deletes (:func:`forget`), for
those whose end was never announced (Redis was down at the time).

The claim is made after the message was acknowledged, so a claim that fails loses the message:
it is tried again on fresh connections for a while first (a connection that a partition
killed while it sat in the pool fails its first command with ``Broken pipe``; issue 19, P2).
Each claim's value is unique, so a try whose reply was lost, and which did set the key, is
recognised as this worker's own claim by the next try, not taken for a duplicate.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

import redis

from dex_tasks.broker import routing

PREFIX = routing.CLAIM_KEY
# Pauses between tries of a claim whose connection failed: the first, and the longest.
RETRY_FIRST_PAUSE = 0.1
RETRY_MAX_PAUSE = 1.0

log = logging.getLogger("dex_tasks.worker.claims")


def claim_key(idempotency_key: str) -> str:
    """The Redis key of a call's claim."""
    return PREFIX + idempotency_key


def try_claim(client: redis.Redis, idempotency_key: str, owner: str, ttl: int, *,
              retry_seconds: float = 0.0) -> bool:
    """Take the claim; True if this caller is the first ever to do so.

    A connection error or timeout is tried again, on a fresh connection, for up to
    ``retry_seconds``; after that the error propagates (the caller cannot tell whether the
    claim is its own, and must not run the tool).
    """
    value = json.dumps({"owner": owner, "at": time.time(), "claim": secrets.token_hex(8)})
    key = claim_key(idempotency_key)
    deadline = time.monotonic() + retry_seconds
    pause = RETRY_FIRST_PAUSE
    attempt = 1
    while True:
        try:
            if client.set(key, value, nx=True, ex=ttl):
                return True
            # Taken. By another delivery, or by an earlier try of this very claim whose reply
            # was lost (here, or in redis-py's own retry of the command): then it holds our
            # unique value.
            return client.get(key) == value.encode()
        except (redis.ConnectionError, redis.TimeoutError) as err:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("Redis claim failed; trying again on a fresh connection", extra={
                "action": "claim_retry", "key": ascii(idempotency_key[:120]),
                "attempt": attempt, "error": f"{type(err).__name__}: {err}"})
            # Drop the idle pooled connections (they may all be dead alike); connections
            # other threads are using are left to them.
            client.connection_pool.disconnect(inuse_connections=False)
        time.sleep(pause)
        pause = min(pause * 2, RETRY_MAX_PAUSE)
        attempt += 1


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


def shorten(client: redis.Redis, idempotency_key: str, ttl: int) -> None:
    """Cut what is left of a claim's life to ``ttl`` seconds (its call has ended). Best effort:
    a claim left whole costs memory, never correctness."""
    try:
        client.expire(claim_key(idempotency_key), ttl)
    except redis.RedisError:
        log.debug("a claim's TTL was not shortened", exc_info=True)


def forget(client: redis.Redis, idempotency_keys: list[str]) -> int:
    """Delete the claims of pruned calls; returns how many existed."""
    if not idempotency_keys:
        return 0
    return int(client.delete(*(claim_key(key) for key in idempotency_keys)))
