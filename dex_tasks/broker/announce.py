"""Sending the notifications of ended calls: a store hook that announces each call's end on
Redis, after the commit that ended it, and counts it for ``/metrics``.

:class:`EndedNotifier` runs after every commit that ended calls, whoever committed it: a
worker finishing a tool, the main process recording a lost child, a sweep reaping, expiring or
failing calls, a client rejecting one or ending it "did not run". In one Redis round trip it
publishes each call's new status on its channel (``ended.ended_channel``) and its
session's (``ended.session_channel``), counts the call
(:func:`metrics.ended_counts`), cuts the claim of an ended single-attempt call and drops the
run of an ended retrying one, in one command (:data:`ANNOUNCE_SCRIPT`) for the one call a
worker ends at a time. Wired by :func:`install` wherever a store that ends calls is built
(``execution.Runtime``, ``DexClient``). Redis being down never fails or holds up the
transition: the hook logs once, stays quiet for a second, and waiters fall back to polling.

The waiting side is in ``notify.py``; the format of a message, and its signed record, in
``ended.py``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dex_tasks.broker.ended import (
    Connect,
    RecordSigner,
    ended_channel,
    ended_message,
    redis_connector,
    session_channel,
    session_message,
)
from dex_tasks.broker.metrics import ENDED_KEY, count_ended, ended_counts
from dex_tasks.broker.redis_clients import CommandArg, pack_command, send_script
from dex_tasks.broker.routing import CLAIM_KEY
from dex_tasks.broker.runs import RUNS_KEY, attempts_key, run_key
from dex_tasks.policy import RETRYING_EFFECTS

if TYPE_CHECKING:
    from dex_tasks.store import EndedCall, Store

log = logging.getLogger("dex_tasks.broker.announce")

REDIS_TIMEOUT_SECONDS = 1.0
"""Connect and reply timeout of the notifier's Redis client: a dead Redis delays a commit's
hooks by at most this much, once per quiet period."""

QUIET_AFTER_ERROR_SECONDS = 1.0
"""How long a notifier that could not reach Redis stays quiet before it tries again."""

SCRIPT_MAX_CALLS = 32
"""The most ended calls announced by one run of :data:`ANNOUNCE_SCRIPT`; a larger batch (a
sweep's) goes as a pipeline, so that no single script holds Redis for long."""

ANNOUNCE_SCRIPT = """
local c = tonumber(ARGV[2])
for k = 3, c + 2 do
  redis.call('EXPIRE', KEYS[k], ARGV[1])
end
local r = tonumber(ARGV[3])
local i = 4
local k = c + 3
for _ = 1, r do
  redis.call('DEL', KEYS[k + 1])
  if ARGV[i] ~= '' and redis.call('HGET', KEYS[k], 'worker') == ARGV[i] then
    redis.call('DEL', KEYS[k])
    redis.call('ZREM', KEYS[2], ARGV[i + 1])
  end
  i = i + 2
  k = k + 2
end
local n = tonumber(ARGV[i])
i = i + 1
for _ = 1, n do
  redis.call('PUBLISH', ARGV[i], ARGV[i + 1])
  i = i + 2
end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i < #ARGV do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  i = i + 2
end
"""
"""What a notifier runs for a few ended calls, in one command.

* ``EXPIRE`` of the claims of the ended single-attempt calls to ``ARGV[1]`` seconds
  (``ARGV[2]`` of them: ``KEYS[3:]``);
* the end of each ended retrying call's run (``ARGV[3]`` of them; ``broker/runs.py``): its
  attempt count deleted, and its run dropped from the run hash and ``dex:runs``
  (``KEYS[2]``) if the worker that ended it (its ``(owner, key)`` pair in ``ARGV``) still
  holds it, which is what ``Runs.release(..., ended=True)`` does, in the same round trip;
* ``PUBLISH`` of each call's status on its channel and on its session's (a count, then
  (channel, message) pairs: ``_publishes``);
* the ``HINCRBY`` (a count, then (field, amount) pairs) and ``HINCRBYFLOAT`` ((field,
  seconds) pairs) counter updates of ``metrics.ended_counts`` on ``KEYS[1]``
  (:data:`metrics.ENDED_KEY`).

The same commands as the pipeline, for about half the client's CPU: a worker child announces
every call it ends, and redis-py spends about as much CPU on each command of a pipeline as on
the round trip of the whole. Folding the run's release in saves a worker child a third Redis
round trip per retrying call (start, end; the end was two: announce, release)."""

ANNOUNCE_SHA = hashlib.sha1(ANNOUNCE_SCRIPT.encode()).hexdigest()
"""The SHA1 ``EVALSHA`` names :data:`ANNOUNCE_SCRIPT` by."""

def ended_claims(ended: Sequence[EndedCall]) -> list[str]:
    """The Redis claim keys of the single-attempt calls among ``ended`` (only they have one)."""
    return [CLAIM_KEY + call.key for call in ended if call.effect not in RETRYING_EFFECTS]


def ended_runs(ended: Sequence[EndedCall]) -> list[tuple[str, str]]:
    """``(key, owner)`` of the retrying calls among ``ended``, whose run in Redis ends with
    them (``broker/runs.py``): ``owner`` is the worker the ended row names (the attempt that
    ended it), or "" when it names none, which drops only the attempt count."""
    return [(call.key, call.worker or "")
            for call in ended if call.effect in RETRYING_EFFECTS]




def _publishes(ended: Sequence[EndedCall],
               signer: RecordSigner | None) -> list[tuple[str, str]]:
    """What announces ``ended``: each call's end on its own channel, for any waiter, and on
    its session's, for the client that sent it (``notify.CallWatcher.sent``)."""
    serializer = signer.serializer() if signer is not None else None
    out: list[tuple[str, str]] = []
    for call in ended:
        message = ended_message(call, serializer)
        out += ((ended_channel(call.key), message),
                (session_channel(call.session_id), session_message(call.key, message)))
    return out


class EndedNotifier:
    """Store hook: announces ended calls on Redis and counts them, after the commit.

    Never raises: an unreachable Redis is logged (once per outage) and the notifier skips
    Redis for :data:`QUIET_AFTER_ERROR_SECONDS`, so a store that keeps ending calls during an
    outage does not wait on Redis for each of them.

    Up to :data:`SCRIPT_MAX_CALLS` calls go as one run of :data:`ANNOUNCE_SCRIPT` (``scripted``,
    the default, until Redis refuses scripts), more as a pipeline of the same commands.

    The same round trip cuts the Redis claim of each ended single-attempt call to
    ``claim_ended_ttl`` seconds: the store's ended record refuses a second claim by itself, so
    the claim is only worth keeping while the call is in flight (a claim whose end was never
    announced keeps its own TTL, and ``dex-tasks prune`` deletes it with its call).
    """

    def __init__(self, target: str, connect: Connect, *, scripted: bool = True,
                 claim_ended_ttl: int = 60, signer: RecordSigner | None = None) -> None:
        self.target = target
        self.claim_ended_ttl = claim_ended_ttl
        self._connect = connect
        # Signs the ended records handed to waiters (None: each announces only the status).
        self.signer = signer
        self._client: redis.Redis | None = None
        self._quiet_until = 0.0
        self._failing = False
        # Whether a few ended calls go as one run of ANNOUNCE_SCRIPT (else as a pipeline);
        # cleared for good when this Redis refuses scripts (an ACL without @scripting).
        self.scripted = scripted

    @property
    def client(self) -> redis.Redis:
        """The notifier's own Redis client: short timeouts and no retries (created on first
        use; redis-py's pool opens new connections after a fork by itself)."""
        if self._client is None:
            client = self._connect(REDIS_TIMEOUT_SECONDS)
            client.set_retry(Retry(NoBackoff(), 0))
            self._client = client
        return self._client

    def hold_off(self, seconds: float = QUIET_AFTER_ERROR_SECONDS) -> None:
        """Announce nothing for ``seconds``: the caller just found Redis unreachable (a
        publish failed), so the calls it now ends must not wait on Redis a second time."""
        self._quiet_until = max(self._quiet_until, time.monotonic() + seconds)

    def __call__(self, ended: Sequence[EndedCall]) -> None:
        if not ended or time.monotonic() < self._quiet_until:
            return
        try:
            if not (self.scripted and len(ended) <= SCRIPT_MAX_CALLS
                    and self._announce_scripted(ended)):
                self._announce_pipelined(ended)
        except Exception as err:  # noqa: BLE001 - a notification is never worth a failure
            self._quiet_until = time.monotonic() + QUIET_AFTER_ERROR_SECONDS
            if not self._failing:
                self._failing = True
                log.warning("ended calls not announced on Redis; waiters fall back to "
                            "polling the store", extra={"action": "notify_failed",
                                                        "calls": len(ended),
                                                        "error": f"{type(err).__name__}: {err}"})
            return
        if self._failing:
            self._failing = False
            log.info("ended calls announced on Redis again", extra={"action": "notify_resumed"})

    def _announce_scripted(self, ended: Sequence[EndedCall]) -> bool:
        """Announce and count ``ended`` with one ``EVALSHA`` of :data:`ANNOUNCE_SCRIPT`; False
        if Redis refused the script or it stopped on an error, and the pipeline is to be sent
        instead. Connection errors propagate, as the pipeline's do."""
        counts, totals = ended_counts(ended)
        claims = ended_claims(ended)
        ran = ended_runs(ended)
        keys: list[CommandArg] = [ENDED_KEY, RUNS_KEY, *claims]
        args: list[CommandArg] = [self.claim_ended_ttl, len(claims), len(ran)]
        for key, owner in ran:
            keys += (run_key(key), attempts_key(key))
            args += (owner, key)
        args.append(2 * len(ended))
        for channel_message in _publishes(ended, self.signer):
            args += channel_message
        args.append(len(counts))
        for name, n in counts.items():
            args += (name, n)
        for name, seconds in totals.items():
            args += (name, seconds)
        client = self.client
        # Packed here and sent with less of redis-py's machinery than execute_command
        # (redis_clients.send_packed): a worker child sends this for every call it ends.
        command = pack_command("EVALSHA", ANNOUNCE_SHA, len(keys), *keys, *args)
        try:
            send_script(client, ANNOUNCE_SCRIPT, command)
        except redis.exceptions.ResponseError as err:
            # The pipeline's plain commands may still work. (A script stopped part-way, by a
            # wrong-typed counters hash or an out-of-memory Redis, had published first: the
            # pipeline publishes again, which only makes waiters read the store once more, and
            # meets the same error at the same counter, so nothing is counted twice.)
            if isinstance(err, redis.exceptions.NoPermissionError) or (
                    "unknown command" in str(err).lower()):
                # Scripts refused for good (an ACL without @scripting, EVALSHA renamed away).
                self.scripted = False
                log.warning("Redis refused the announcement script; announcing with plain "
                            "commands", extra={"action": "notify_script_refused",
                                               "error": f"{type(err).__name__}: {err}"})
            return False
        return True

    def _announce_pipelined(self, ended: Sequence[EndedCall]) -> None:
        """Announce and count ``ended`` in one pipeline of plain commands."""
        pipe = self.client.pipeline(transaction=False)
        for key in ended_claims(ended):
            pipe.expire(key, self.claim_ended_ttl)
        # Without scripts a run cannot be dropped only if its owner still holds it: the
        # attempt counts go, and the runs lapse with their leases (the reaper then finds
        # their calls ended and drops them).
        for key, _ in ended_runs(ended):
            pipe.delete(attempts_key(key))
        for channel, message in _publishes(ended, self.signer):
            pipe.publish(channel, message)
        count_ended(pipe, ended)
        pipe.execute()

    def close(self) -> None:
        """Close the notifier's Redis connections."""
        if self._client is not None:
            self._client.close()
            self._client = None


def install(store: Store, redis_url: str, connect: Connect | None = None, *,
            claim_ended_ttl: int = 60) -> EndedNotifier:
    """Make every call ``store`` ends announced on the Redis at ``redis_url`` (and counted),
    with its ended record signed with the store's shared key (``ended.RecordSigner``);
    returns the store's notifier (the one already installed for that Redis, if any).
    ``connect`` makes its Redis clients (default: :func:`redis_connector` of the URL);
    ``claim_ended_ttl`` is what is left of an ended single-attempt call's claim
    (``DexSettings.claim_ended_ttl_seconds``)."""
    for hook in store.ended_hooks():
        if isinstance(hook, EndedNotifier) and hook.target == redis_url:
            return hook
    notifier = EndedNotifier(redis_url, connect or redis_connector(redis_url),
                             claim_ended_ttl=claim_ended_ttl,
                             signer=RecordSigner(store))
    store.on_calls_ended(notifier)
    return notifier
