"""Notifications when calls end: waiters wake at once instead of polling the store.

Two sides, both on Redis pub/sub, one channel per call (``dex:ended:<key>``):

* **Sending** (:class:`EndedNotifier`): a hook on the store (``Store.on_calls_ended``) that
  runs after every commit that ended calls, whoever committed it: a worker finishing a tool,
  the main process recording a lost child, a sweep reaping, expiring or failing calls, a
  client rejecting one or ending it "did not run". In one Redis round trip it publishes each
  call's new status on its channel and counts the call for ``/metrics``
  (:func:`metrics.ended_counts`), in one command (a Lua script) for the one call a worker
  ends at a time. Wired by :func:`install` wherever a store that ends calls is
  built (``execution.Runtime``, ``DexClient``). Redis being down never fails or holds up the
  transition: the hook logs once, stays quiet for a second, and waiters fall back to polling.
* **Waiting** (:class:`CallWatcher`): one pub/sub connection per client, read by a
  background thread, shared by every ``wait`` of the client (sync and async). A
  waiter reads the store, subscribes to its call's channel and reads the store again on every
  wake-up: when its subscription is confirmed, when a message arrives, when the connection is
  lost, and every ``wait_poll_seconds`` regardless. A notification only says "read the store
  now"; the store stays the one source of truth, so a message that is lost (Redis down, a
  publish that failed, a subscription confirmed after the call ended) costs at most one poll
  interval, never a wrong answer.

Why pub/sub and not a per-call list with ``BLPOP``: ``BLPOP`` needs no confirmation step, but it
holds one Redis connection per waiting call (an asyncio agent waiting on 40 calls at once holds
40), leaves a key per ended call in Redis until it expires, and wakes only one of several
waiters of the same call. Pub/sub costs two connections per client (one to listen, one to wake
the listening thread) and nothing in Redis when nobody listens; the race it has (a call ending
between the waiter's read and its subscription) is closed by reading the store again once the
subscription is confirmed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from itsdangerous import BadData, Serializer
from redis.backoff import NoBackoff
from redis.retry import Retry

from dex_tasks.broker.metrics import ENDED_KEY, count_ended, ended_counts
from dex_tasks.broker.routing import CLAIM_KEY
from dex_tasks.broker.runs import RUNS_KEY, attempts_key, run_key
from dex_tasks.policy import RETRYING_EFFECTS

if TYPE_CHECKING:
    from dex_tasks.store import EndedCall, Store

log = logging.getLogger("dex_tasks.broker.notify")

CHANNEL_PREFIX = "dex:ended:"
"""Prefix of the pub/sub channel of one call: ``dex:ended:<idempotency key>``."""

QUIET_AFTER_ERROR_SECONDS = 1.0
"""How long a notifier that could not reach Redis stays quiet before it tries again."""

REDIS_TIMEOUT_SECONDS = 1.0
"""Connect and reply timeout of the notifier's Redis client: a dead Redis delays a commit's
hooks by at most this much, once per quiet period."""

Connect = Callable[[float], redis.Redis]
"""Makes a Redis client whose socket and connect timeouts are the given seconds."""

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
* ``PUBLISH`` of each call's status on its channel (a count, then (channel, message) pairs);
* the ``HINCRBY`` (a count, then (field, amount) pairs) and ``HINCRBYFLOAT`` ((field,
  seconds) pairs) counter updates of ``metrics.ended_counts`` on ``KEYS[1]``
  (:data:`metrics.ENDED_KEY`).

The same commands as the pipeline, for about half the client's CPU: a worker child announces
every call it ends, and redis-py spends about as much CPU on each command of a pipeline as on
the round trip of the whole. Folding the run's release in saves a worker child a third Redis
round trip per retrying call (start, end; the end was two: announce, release)."""

ANNOUNCE_SHA = hashlib.sha1(ANNOUNCE_SCRIPT.encode()).hexdigest()
"""The SHA1 ``EVALSHA`` names :data:`ANNOUNCE_SCRIPT` by."""

# The watcher's connection: its reply timeout, how long it may hear nothing before it pings,
# and how long without any reply (pong included) before it takes the connection for dead and
# opens another.
_WATCHER_SOCKET_TIMEOUT = 5.0
_IDLE_PING_SECONDS = 5.0
_DEAD_AFTER_SECONDS = 15.0
_RECONNECT_FIRST_PAUSE = 0.05
_RECONNECT_MAX_PAUSE = 2.0


def ended_channel(key: str) -> str:
    """The pub/sub channel the end of call ``key`` is announced on."""
    return CHANNEL_PREFIX + key


RECORD_SALT = "dex-tasks.ended-record"
"""Salt of the signature of an ended record handed to waiters (apart from the tokens')."""

MAX_RECORD_CHARS = 32_000
"""An ended record longer than this (a large result) is not sent: its waiters read the
store, as every waiter of a notifier without a secret does."""


def record_serializer(secret: str | None) -> Serializer[str] | None:
    """How ended records are signed and checked with ``DEX_SECRET_KEY`` (None without one:
    then no record travels, and waiters read the store)."""
    return Serializer(secret, salt=RECORD_SALT) if secret else None


def ended_message(call: EndedCall, signer: Serializer[str] | None) -> str:
    """What the end of ``call`` publishes on its channel: its status, then (after a space)
    the ended row, signed, which its waiters take instead of reading the store; or only the
    status (no secret, a row the ending did not return, or one too large), which makes them
    read it."""
    if signer is None or call.record is None:
        return call.status.value
    text = f"{call.status.value} {signer.dumps(call.record)}"
    return text if len(text) <= MAX_RECORD_CHARS else call.status.value


def message_status(message: str | bytes) -> str:
    """The status an end notification announces (its first word)."""
    if isinstance(message, bytes):
        message = message.decode("utf-8", "surrogateescape")
    return message.split(" ", 1)[0]


def ended_record(message: str | bytes | None, signer: Serializer[str] | None,
                 key: str) -> dict[str, Any] | None:
    """The ended row of call ``key`` a notification carried, if it is one, signed with our
    secret, for that call and terminal; None otherwise (read the store). Redis is not
    trusted with a call's outcome: a message anyone could publish is checked first."""
    if signer is None or message is None:
        return None
    if isinstance(message, bytes):
        message = message.decode("utf-8", "surrogateescape")
    _, _, signed = message.partition(" ")
    if not signed:
        return None  # a bare status
    try:
        record = signer.loads(signed)
    except (BadData, ValueError):
        log.warning("a call's end notification failed its signature check; reading the store",
                    extra={"action": "ended_record_refused"})
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return record


def ended_claims(ended: Sequence[EndedCall]) -> list[str]:
    """The Redis claim keys of the single-attempt calls among ``ended`` (only they have one)."""
    return [CLAIM_KEY + call.key for call in ended if call.effect not in RETRYING_EFFECTS]


def ended_runs(ended: Sequence[EndedCall]) -> list[tuple[str, str]]:
    """``(key, owner)`` of the retrying calls among ``ended``, whose run in Redis ends with
    them (``broker/runs.py``): ``owner`` is the worker the ended row names (the attempt that
    ended it), or "" when it names none, which drops only the attempt count."""
    return [(call.key, str((call.record or {}).get("worker") or ""))
            for call in ended if call.effect in RETRYING_EFFECTS]


# -- sending ------------------------------------------------------------------------------------


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
                 claim_ended_ttl: int = 60, secret: str | None = None) -> None:
        self.target = target
        self.claim_ended_ttl = claim_ended_ttl
        self._connect = connect
        # Signs the ended records handed to waiters (none without a secret).
        self.signer = record_serializer(secret)
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
        keys = [ENDED_KEY, RUNS_KEY, *claims]
        args: list[str | int | float] = [self.claim_ended_ttl, len(claims), len(ran)]
        for key, owner in ran:
            keys += (run_key(key), attempts_key(key))
            args += (owner, key)
        args.append(len(ended))
        for call in ended:
            args += (ended_channel(call.key), ended_message(call, self.signer))
        args.append(len(counts))
        for name, n in counts.items():
            args += (name, n)
        for name, seconds in totals.items():
            args += (name, seconds)
        client = self.client
        # execute_command (untyped in redis-py), not evalsha(): one frame less per call.
        evalsha: Callable[..., Any] = client.execute_command
        try:
            try:
                evalsha("EVALSHA", ANNOUNCE_SHA, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                # Not loaded on this server yet (first use, a restart, a failover): the
                # script fails before it runs a command, so running it again repeats nothing.
                client.script_load(ANNOUNCE_SCRIPT)
                evalsha("EVALSHA", ANNOUNCE_SHA, len(keys), *keys, *args)
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
        for call in ended:
            pipe.publish(ended_channel(call.key), ended_message(call, self.signer))
        count_ended(pipe, ended)
        pipe.execute()

    def close(self) -> None:
        """Close the notifier's Redis connections."""
        if self._client is not None:
            self._client.close()
            self._client = None


def install(store: Store, redis_url: str, connect: Connect | None = None, *,
            claim_ended_ttl: int = 60, secret: str | None = None) -> EndedNotifier:
    """Make every call ``store`` ends announced on the Redis at ``redis_url`` (and counted);
    returns the store's notifier (the one already installed for that Redis, if any).
    ``connect`` makes its Redis clients (default: :func:`redis_connector` of the URL);
    ``claim_ended_ttl`` is what is left of an ended single-attempt call's claim
    (``DexSettings.claim_ended_ttl_seconds``); ``secret`` (``DEX_SECRET_KEY``) signs the ended
    records it hands to waiters."""
    for hook in store.ended_hooks():
        if isinstance(hook, EndedNotifier) and hook.target == redis_url:
            if secret and hook.signer is None:
                hook.signer = record_serializer(secret)
            return hook
    notifier = EndedNotifier(redis_url, connect or redis_connector(redis_url),
                             claim_ended_ttl=claim_ended_ttl, secret=secret)
    store.on_calls_ended(notifier)
    return notifier


# -- waiting ------------------------------------------------------------------------------------


class Watch:
    """One waiter's interest in one call: woken (``wait`` returns True, ``on_wake`` runs) when
    the call's channel has news, the subscription is confirmed, or the connection changes."""

    def __init__(self, watcher: CallWatcher, channel: str,
                 on_wake: Callable[[], None] | None) -> None:
        self.watcher = watcher
        self.channel = channel
        self._on_wake = on_wake
        self._event = threading.Event()
        # The last message heard on the channel: a signed ended record, or a bare status.
        self.message: str | bytes | None = None

    @property
    def live(self) -> bool:
        """Whether notifications can reach this watch now (see :attr:`CallWatcher.live`)."""
        return self.watcher.live

    def wake(self, message: str | bytes | None = None) -> None:
        """Wake the waiter (called from the watcher's thread), with what its channel said."""
        if message is not None:
            self.message = message
        self._event.set()
        if self._on_wake is not None:
            try:
                self._on_wake()
            except Exception:
                # e.g. the waiting coroutine's event loop has closed: nobody to wake.
                log.debug("a waiter's wake-up callback failed", exc_info=True)

    def wait(self, timeout: float) -> bool:
        """Block until woken or ``timeout``; True if woken. Clears the wake-up."""
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken

    def close(self) -> None:
        """Stop watching (unsubscribes when this was the channel's last watch)."""
        self.watcher.release(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class CallWatcher:
    """The waiting side: one Redis pub/sub connection, read by a background thread.

    redis-py's pub/sub objects must not be shared between threads, so only the watcher's thread
    touches its connection: waiters queue SUBSCRIBE / UNSUBSCRIBE requests, which the thread
    sends in the order they were made, and a waiter that needs a subscription now wakes the
    thread by publishing to the thread's own channel. The thread starts on first use,
    reconnects with backoff when the connection is lost, and then wakes every waiter (they
    poll the store quickly until it is back).
    """

    def __init__(self, connect: Connect) -> None:
        self._connect = connect
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._watches: dict[str, list[Watch]] = {}
        self._requests: list[tuple[str, str]] = []
        self._thread: threading.Thread | None = None
        self._poker: redis.Redis | None = None
        self._own_channel = f"dex:watcher:{uuid.uuid4().hex}"
        self._live = False
        self._failed = False  # a connection failed and no new one is up yet
        self._closed = False

    @property
    def live(self) -> bool:
        """Whether notifications can reach the waiters: the watcher is connected, or making
        its first connection (which ends in a wake-up either way: each subscription's
        confirmation, or every waiter woken when it fails). False while Redis is down."""
        return self._live or not self._failed

    def watch(self, key: str, on_wake: Callable[[], None] | None = None) -> Watch:
        """Start watching call ``key``; the caller reads the store after each wake-up and
        closes the watch when done (``with watcher.watch(key) as w: ...``)."""
        if self._pid != os.getpid():
            # A forked child cannot use its parent's thread or connection: start afresh.
            self._reset()
        channel = ended_channel(key)
        watch = Watch(self, channel, on_wake)
        with self._lock:
            if self._closed:
                raise RuntimeError("the call watcher is closed")
            self._start()
            watches = self._watches.setdefault(channel, [])
            watches.append(watch)
            first = len(watches) == 1
            if first:
                self._requests.append(("subscribe", channel))
        if first:
            self._poke()
        return watch

    def release(self, watch: Watch) -> None:
        """Forget ``watch``; unsubscribe its channel if no other watch needs it. (Nothing waits
        for that: the thread sends it with its next command, or within a second.)"""
        with self._lock:
            watches = self._watches.get(watch.channel)
            if watches is None or watch not in watches:
                return
            watches.remove(watch)
            if not watches:
                del self._watches[watch.channel]
                self._requests.append(("unsubscribe", watch.channel))

    def close(self) -> None:
        """Stop the thread and close its connections (waits up to two seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None and self._pid == os.getpid():
            self._poke()
            thread.join(2.0)
        if self._poker is not None:
            self._poker.close()

    def _start(self) -> None:
        # Under self._lock.
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dex-call-watcher",
                                             daemon=True)
            self._thread.start()

    def _poke(self) -> None:
        """Wake the watcher's thread out of its read, so it sends the queued commands now."""
        try:
            if self._poker is None:
                self._poker = self._connect(REDIS_TIMEOUT_SECONDS)
            self._poker.publish(self._own_channel, b"")
        except Exception:
            log.debug("could not wake the call watcher", exc_info=True)

    def _wake(self, channel: str | None, message: str | bytes | None = None) -> None:
        with self._lock:
            if channel is None:
                watches = [w for ws in self._watches.values() for w in ws]
            else:
                watches = list(self._watches.get(channel, ()))
        for watch in watches:
            watch.wake(message)

    # -- the watcher's thread -------------------------------------------------------------------

    def _run(self) -> None:
        pause = _RECONNECT_FIRST_PAUSE
        failing = False
        while not self._closed:
            client = self._connect(_WATCHER_SOCKET_TIMEOUT)
            client.set_retry(Retry(NoBackoff(), 0))  # the loop below reconnects, not redis-py
            pubsub = client.pubsub()  # type: ignore[no-untyped-call]
            try:
                with self._lock:
                    channels = list(self._watches)
                    self._requests.clear()  # the snapshot covers them
                pubsub.subscribe(self._own_channel, *channels)
                self._live = True
                self._failed = False
                if failing:
                    log.info("call watcher reconnected", extra={"action": "watcher_resumed"})
                failing = False
                pause = _RECONNECT_FIRST_PAUSE
                self._read(pubsub)
            except Exception as err:  # noqa: BLE001 - any failure: reconnect, waiters poll
                self._failed = True
                if not failing and not self._closed:
                    failing = True
                    log.warning("call watcher lost Redis; waits poll the store until it is "
                                "back", extra={"action": "watcher_failed",
                                               "error": f"{type(err).__name__}: {err}"})
            finally:
                self._live = False
                # Messages may have been missed: every waiter reads the store again.
                self._wake(None)
                try:
                    pubsub.close()
                    client.close()
                except Exception:  # noqa: BLE001 - closing a dead connection
                    pass
            if not self._closed:
                time.sleep(pause)
                pause = min(pause * 2, _RECONNECT_MAX_PAUSE)

    def _read(self, pubsub: Any) -> None:
        heard = pinged = time.monotonic()
        while not self._closed:
            self._send(pubsub)
            message = pubsub.get_message(timeout=1.0)
            now = time.monotonic()
            if message is None:
                if now - heard > _DEAD_AFTER_SECONDS:
                    raise ConnectionError(f"no reply from Redis for {now - heard:.0f}s")
                if now - heard > _IDLE_PING_SECONDS and now - pinged > _IDLE_PING_SECONDS:
                    pinged = now
                    pubsub.ping()
                continue
            heard = now
            if message.get("type") in ("message", "subscribe"):
                channel = message.get("channel")
                if isinstance(channel, bytes):
                    channel = channel.decode("utf-8", "surrogateescape")
                # A confirmed subscription wakes its waiters too: their call may have ended
                # before it, and they must read the store once more.
                data = message.get("data") if message.get("type") == "message" else None
                self._wake(str(channel), data if isinstance(data, str | bytes) else None)

    def _send(self, pubsub: Any) -> None:
        """Send the queued requests in order; consecutive ones of a kind in one command, so a
        channel released and watched again ends subscribed."""
        with self._lock:
            batch, self._requests = self._requests, []
        run: list[str] = []
        for i, (kind, channel) in enumerate(batch):
            run.append(channel)
            if i + 1 == len(batch) or batch[i + 1][0] != kind:
                (pubsub.subscribe if kind == "subscribe" else pubsub.unsubscribe)(*run)
                run = []


def redis_connector(redis_url: str) -> Connect:
    """How notify's clients reach Redis: ``connect(timeout)`` makes a client of ``redis_url``
    with that socket and connect timeout."""

    def connect(timeout: float) -> redis.Redis:
        return redis.Redis.from_url(redis_url, socket_timeout=timeout,
                                    socket_connect_timeout=timeout)

    return connect
