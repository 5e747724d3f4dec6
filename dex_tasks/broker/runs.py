"""Running calls of the retrying path, kept in Redis instead of the store (DESIGN version 4).

A call of the retrying path (``read``, ``idempotent_write``) writes the store twice: when it
is requested and when it ends. While an attempt runs, the store still says ``queued``; the
attempt is here:

* ``dex:run:<key>``, a hash: the ``worker`` (owner id) running it, when it ``started`` and
  its ``attempt`` number;
* ``dex:runs``, a sorted set of the running keys scored by when their lease runs out, on
  Redis's clock (``TIME``; no worker's clock plays a part). The worker's main process renews
  the leases of what its children run (:meth:`Runs.renew`); a lease that runs out is a lost
  worker, which the reaper finds here (:meth:`Runs.expired`, :meth:`Runs.reap`) and delivers
  again, or ends once its attempts ran out;
* ``dex:attempts:<key>``, the attempt count, which outlives each run (TTL
  ``claim_ttl_seconds``) so that ``max_attempts`` still ends a call that keeps losing its
  worker. Redis losing it (a failover) may allow more attempts than ``max_attempts``, which
  the effect class allows; it never loses a call, since the store still has it queued.

Readers that show a call (the snapshot, the session page, ``get_tool_call``, ``/metrics``)
overlay the run on the stored row (:meth:`Runs.overlay`): a queued call with a live run shows
``running`` with its worker and attempt.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from dex_tasks.broker.redis_clients import Pending, pack_command, send_script
from dex_tasks.states import CallStatus

log = logging.getLogger("dex_tasks.broker.runs")

RUN_PREFIX = "dex:run:"
ATTEMPTS_PREFIX = "dex:attempts:"
RUNS_KEY = "dex:runs"
"""Sorted set of the running keys, scored by lease expiry (Redis's clock, seconds)."""

BUSY = -1
"""What :meth:`Runs.start` returns when another attempt holds a live lease on the call."""

# KEYS: run hash, attempts key, runs zset. ARGV: key, stored attempts, max attempts, owner,
# started (the worker's time, for display only), lease seconds, attempts TTL, tool, effect.
# Returns the attempt number started, BUSY, or {0, count} when no attempt is left.
_START = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local lease = redis.call('ZSCORE', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 and lease and tonumber(lease) >= now then
  return -1
end
local n = tonumber(redis.call('GET', KEYS[2]) or '0')
local stored = tonumber(ARGV[2])
if stored > n then n = stored end
if n >= tonumber(ARGV[3]) then return {0, n} end
n = n + 1
redis.call('SET', KEYS[2], n, 'EX', ARGV[7])
redis.call('HSET', KEYS[1], 'worker', ARGV[4], 'started', ARGV[5], 'attempt', n,
           'tool', ARGV[8], 'effect', ARGV[9])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[1])
return n
"""

# KEYS: run hash, attempts key, runs zset. ARGV: key, owner, attempt, TTL. Takes back the start
# of ``attempt`` by ``owner`` (made by :meth:`Runs.start_later` before its call was read): its
# run and lease if they are still that attempt's, its count if it is still that attempt's (the
# count it followed restored, or none). Returns 1 if the run was dropped.
_UNDO_START = """
local dropped = 0
local run = redis.call('HMGET', KEYS[1], 'worker', 'attempt')
if run[1] == ARGV[2] and run[2] == ARGV[3] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  dropped = 1
end
if redis.call('GET', KEYS[2]) == ARGV[3] then
  local before = tonumber(ARGV[3]) - 1
  if before > 0 then
    redis.call('SET', KEYS[2], before, 'EX', ARGV[4])
  else
    redis.call('DEL', KEYS[2])
  end
end
return dropped
"""

# KEYS: run hash, runs zset, attempts key. ARGV: key, owner, ended. Drops the run if ``owner``
# holds it (1 if so); a call that ended also drops its attempt count.
_RELEASE = """
if ARGV[3] == '1' then redis.call('DEL', KEYS[3]) end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: runs zset, then one run hash per key. ARGV: worker prefix, lease seconds, then keys.
# Extends the leases of the keys whose run the worker (any of its children) holds.
_RENEW = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local renewed = 0
for i = 2, #KEYS do
  local worker = redis.call('HGET', KEYS[i], 'worker')
  if worker and string.sub(worker, 1, #ARGV[1]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[i + 1])
    renewed = renewed + 1
  end
end
return renewed
"""

# KEYS: runs zset, run hash. ARGV: key. Takes a run whose lease has run out: returns
# {worker, attempt} and drops it, or nothing when it was renewed or released meanwhile.
_REAP = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease or tonumber(lease) >= now then return nil end
local run = redis.call('HMGET', KEYS[2], 'worker', 'attempt')
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return {run[1] or '', run[2] or '0'}
"""

# KEYS: runs zset. ARGV: limit. The keys whose lease ran out, on Redis's clock.
_EXPIRED = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, ARGV[1])
"""


def run_key(key: str) -> str:
    """The Redis hash of a call's running attempt."""
    return RUN_PREFIX + key


def attempts_key(key: str) -> str:
    """The Redis key of a call's attempt count."""
    return ATTEMPTS_PREFIX + key


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Run:
    """One running attempt as Redis holds it."""

    worker: str
    attempt: int
    started: float | None = None


R = TypeVar("R")


class Runs:
    """The running attempts of retrying calls, on one Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._start = client.register_script(_START)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._reap = client.register_script(_REAP)
        self._expired = client.register_script(_EXPIRED)
        self._undo_start = client.register_script(_UNDO_START)

    def start(self, key: str, owner: str, *, stored_attempts: int, max_attempts: int,
              lease_seconds: float, started: float, ttl: int, tool: str = "",
              effect: str = "") -> tuple[int, int]:
        """Start an attempt of ``key`` for ``owner``: ``(attempt, count)``.

        ``attempt`` is the number of the attempt started (the count in Redis, or the store's
        when that is larger, plus one); :data:`BUSY` when another attempt holds a live lease
        (a duplicate delivery); 0 when every attempt was used (``count`` says how many).
        """
        # Packed here and sent with less of redis-py's machinery than a Script's call
        # (redis_clients.send_packed): a worker child starts every attempt so.
        command = pack_command("EVALSHA", self._start.sha, 3, run_key(key), attempts_key(key),
                               RUNS_KEY, key, stored_attempts, max_attempts, owner,
                               repr(started), lease_seconds, ttl, tool, effect)
        reply = send_script(self.client, _START, command)
        if isinstance(reply, list):
            return 0, int(reply[1])
        return int(reply), int(reply)

    def start_later(self, key: str, owner: str, *, max_attempts: int, lease_seconds: float,
                    started: float, ttl: int, tool: str, effect: str) -> PendingStart:
        """Send the start of an attempt of ``key`` for ``owner`` before its call is read, and
        read the reply later (:meth:`PendingStart.number`), the call's read in between.

        The store's count is not known yet, nor the call's own ``max_attempts`` (this one is
        the tool's, as last seen): the attempt is numbered after Redis's count alone. The
        caller checks the number against the call once read, and takes the start back
        (:meth:`undo_start`) when the call should not start so (its count in the store is
        larger than Redis's, no attempt is left, it is not queued...). Raises
        ``redis.RedisError`` when the command could not be sent (then it did not run).
        """
        command = pack_command("EVALSHA", self._start.sha, 3, run_key(key), attempts_key(key),
                               RUNS_KEY, key, 0, max_attempts, owner, repr(started),
                               lease_seconds, ttl, tool, effect)
        return PendingStart(Pending(self.client, command))

    def undo_start(self, key: str, owner: str, number: int, *, ttl: int) -> bool:
        """Take back attempt ``number`` of ``key`` that :meth:`start_later` started for
        ``owner``: its run and lease, and its count, each only if still that attempt's (the
        attempt never ran the tool). True if the run was dropped."""
        return bool(self._undo_start(keys=[run_key(key), attempts_key(key), RUNS_KEY],
                                     args=[key, owner, number, ttl]))

    def release(self, key: str, owner: str, *, ended: bool = False) -> bool:
        """Drop ``owner``'s run of ``key`` (its attempt ended, or was recorded lost);
        ``ended``: the call is terminal, its attempt count goes too."""
        return bool(self._release(keys=[run_key(key), RUNS_KEY, attempts_key(key)],
                                  args=[key, owner, "1" if ended else "0"]))

    def running_by_label(self) -> dict[tuple[str, str], int]:
        """How many attempts run now, by (tool, effect): ``/metrics``."""
        keys = [_text(k) for k in self.client.zrange(RUNS_KEY, 0, -1)]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(run_key(key), "tool", "effect")
        counts: dict[tuple[str, str], int] = {}
        for tool, effect in pipe.execute() if keys else []:
            if tool is not None:
                label = (_text(tool), _text(effect or b""))
                counts[label] = counts.get(label, 0) + 1
        return counts

    def renew(self, worker_prefix: str, keys: Sequence[str], lease_seconds: float) -> int:
        """Extend to ``lease_seconds`` from now the leases of ``keys`` that a process of the
        worker ``worker_prefix`` (``<node>:``) runs; returns how many."""
        if not keys:
            return 0
        return int(self._renew(keys=[RUNS_KEY, *(run_key(k) for k in keys)],
                               args=[worker_prefix, lease_seconds, *keys]))

    def get(self, key: str) -> Run | None:
        """``key``'s running attempt, or None."""
        return self.get_many([key]).get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, Run]:
        """The running attempts of ``keys`` that have one (one round trip)."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(run_key(key), "worker", "attempt", "started")
        found: dict[str, Run] = {}
        for key, (worker, attempt, started) in zip(keys, pipe.execute(), strict=True):
            if worker is not None:
                found[key] = Run(_text(worker), int(attempt or 0),
                                 float(started) if started is not None else None)
        return found

    def running(self) -> dict[str, Run]:
        """Every attempt running now, by key."""
        return self.get_many(_text(k) for k in self.client.zrange(RUNS_KEY, 0, -1))

    def attempts(self, key: str) -> int:
        """The attempts counted for ``key`` in Redis (0 when none, or when Redis lost it)."""
        raw = self.client.get(attempts_key(key))
        return int(raw) if raw is not None else 0

    def expired(self, limit: int = 500) -> list[str]:
        """The keys whose lease ran out by Redis's clock (their worker is presumed lost)."""
        return [_text(k) for k in self._expired(keys=[RUNS_KEY], args=[limit])]

    def reap(self, key: str) -> Run | None:
        """Take ``key``'s run if its lease has run out (None if it was renewed or released
        meanwhile: then its worker lives, or it ended)."""
        reply = self._reap(keys=[RUNS_KEY, run_key(key)], args=[key])
        if not reply:
            return None
        return Run(_text(reply[0]), int(reply[1]))

    def forget(self, keys: Sequence[str]) -> None:
        """Drop the attempt counts of calls that ended or were pruned."""
        if keys:
            self.client.delete(*(attempts_key(k) for k in keys))

    def overlay(self, rows: Sequence[R]) -> list[R]:
        """``rows`` (call rows or records with ``key``, ``status``, ``attempts``, ``worker``)
        with each queued one that has a live run shown ``running``, its worker and attempt
        Redis's. Best effort: Redis unreachable shows the rows as stored."""
        queued = [r for r in rows if _status(r) == "queued"]
        if not queued:
            return list(rows)
        try:
            live = self.get_many(_key(r) for r in queued)
        except redis.RedisError as err:
            log.debug("running calls not read from Redis: %s", err)
            return list(rows)
        return [_as_running(r, live[_key(r)]) if _status(r) == "queued" and _key(r) in live
                else r for r in rows]


class PendingStart:
    """An attempt's start sent by :meth:`Runs.start_later`, its reply not read yet."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Pending) -> None:
        self._pending = pending

    def number(self) -> int | None:
        """The attempt number started, :data:`BUSY` (another attempt holds a live lease), or
        None when nothing ran: Redis did not have the script loaded, or counted every attempt
        already. Raises ``redis.RedisError`` when the reply was lost (the start may have
        run)."""
        try:
            reply = self._pending.reply()
        except redis.exceptions.NoScriptError:
            return None
        return None if isinstance(reply, list) else int(reply)


def _key(row: Any) -> str:
    return str(row.key)


def _status(row: Any) -> str:
    status = getattr(row, "status", None)
    return str(getattr(status, "value", status))


def _as_running(row: R, run: Run) -> R:
    """``row`` shown as running ``run`` (a copy: pydantic models and dataclasses alike)."""
    changes: dict[str, Any] = {"attempts": run.attempt, "worker": run.worker}
    status = getattr(row, "status", None)
    changes["status"] = (CallStatus.RUNNING if isinstance(status, CallStatus)
                         else CallStatus.RUNNING.value)
    copy = getattr(row, "model_copy", None)
    if copy is not None:
        fields = getattr(type(row), "model_fields", {})
        return copy(update={k: v for k, v in changes.items() if k in fields})  # type: ignore[no-any-return]
    names = {f.name for f in dataclasses.fields(row)}  # type: ignore[arg-type]
    return dataclasses.replace(row, **{k: v for k, v in changes.items() if k in names})  # type: ignore[type-var]
