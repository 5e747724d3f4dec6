"""Reaching Redis when a process starts: wait while it is not answering, saying so on each try
with how long it has been, and refuse at once what waiting cannot fix.

Celery's consumer, left to itself, prints its banner and then retries a Redis that refuses
the password as patiently as one that is down ("Cannot connect ... Trying again"), for ever,
and a user without a command it needs (an ACL without ``BRPOP``) fails deep inside its loop.
:func:`until_redis_answers` runs before any of that:

* a Redis that is down, restarting, loading its data or read-only during a failover
  (:func:`transient`) is tried again, one line per try with the URL (never its password) and
  the time so far;
* a refused password (``WRONGPASS``, ``NOAUTH``), a command the user may not run (``NOPERM``)
  or one the server does not have, raises :class:`BrokerRefusedError`: one line naming the
  cause and the fix.

The commands a process needs are checked without running any: they are sent inside
``MULTI`` and the transaction is discarded. Redis checks a command's ACL (the command, its
keys, its channels) when it queues it, so each answers ``QUEUED`` or its refusal, and nothing
runs. The keys named are the ones dex-tasks uses, so an ACL that limits keys is checked too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis

from dex_tasks.broker.ended import CHANNEL_PREFIX
from dex_tasks.broker.metrics import ENDED_KEY, SWEEP_STATS_KEY
from dex_tasks.broker.redis_clients import redis_client, safe_url
from dex_tasks.broker.routing import HELD_KEY, UNACKED_KEY, WORKER_KEY, queue_for
from dex_tasks.errors import BrokerRefusedError
from dex_tasks.logs import redact
from dex_tasks.settings import DexSettings

log = logging.getLogger("dex_tasks.broker")

Command = tuple[str, ...]

# What an agent process (call_tool, wait) and the API send: a call's message onto its queue,
# the end-of-call announcement (notify: PUBLISH and the counters) and the subscription that
# wakes a waiter.
CLIENT_COMMANDS: tuple[Command, ...] = (
    ("PING",),
    ("LPUSH", queue_for("preflight"), "x"),
    ("PUBLISH", CHANNEL_PREFIX + "preflight", "x"),
    ("HINCRBY", ENDED_KEY, "preflight", "1"),
    ("SUBSCRIBE", CHANNEL_PREFIX + "preflight"),
)

# What beat sends besides: its sweeps' locks and statistics, the routing's look at which
# workers are alive (SCAN, and INFO for Redis's uptime) and the messages it republishes.
BEAT_COMMANDS: tuple[Command, ...] = (
    *CLIENT_COMMANDS,
    ("SET", "dex:sweep-lock:preflight", "x", "NX", "PX", "1000"),
    ("GET", "dex:sweep-lock:preflight"),
    ("DEL", "dex:sweep-lock:preflight"),
    # (redis-py's lock releases and extends itself with scripts)
    ("EVALSHA", "0" * 40, "1", "dex:sweep-lock:preflight", "x"),
    ("HSET", SWEEP_STATS_KEY, "preflight", "1"),
    ("SCAN", "0", "MATCH", WORKER_KEY + "*", "COUNT", "1"),
    ("HVALS", UNACKED_KEY),
    ("INFO", "server"),
)

# What a worker sends besides: Celery's consumer on the Redis transport (BRPOP over its
# queues, the unacknowledged messages' hash and index, the queue bindings), the claims of
# single-attempt calls, and its presence (which tools it serves, which messages it holds).
WORKER_COMMANDS: tuple[Command, ...] = (
    *BEAT_COMMANDS,
    ("BRPOP", queue_for("preflight"), "1"),
    ("LLEN", queue_for("preflight")),
    ("SADD", "_kombu.binding." + queue_for("preflight"), "x"),
    ("HSET", UNACKED_KEY, "preflight", "x"),
    ("HDEL", UNACKED_KEY, "preflight"),
    ("ZADD", "unacked_index", "0", "preflight"),
    ("ZREM", "unacked_index", "preflight"),
    ("ZRANGEBYSCORE", "unacked_index", "0", "0"),
    ("SET", "dex:claim:preflight", "x", "NX", "EX", "1"),
    ("SET", WORKER_KEY + "preflight", "x", "EX", "1"),
    ("SADD", HELD_KEY + "preflight", "x"),
    ("EXPIRE", HELD_KEY + "preflight", "1"),
)

ROLES: dict[str, tuple[Command, ...]] = {
    "client": CLIENT_COMMANDS, "beat": BEAT_COMMANDS, "worker": WORKER_COMMANDS,
}

# How long a try at start-up may take, and the pauses between tries (the first, the longest).
CHECK_TIMEOUT_SECONDS = 5.0
FIRST_PAUSE_SECONDS = 1.0
MAX_PAUSE_SECONDS = 5.0


def transient(err: redis.RedisError) -> bool:
    """True when waiting may cure ``err``: Redis down or unreachable (refused, reset, timed
    out, no master found through the Sentinels), loading its data, busy, or a replica that
    refuses writes while a failover promotes another (``READONLY``). A refused password, a
    refused command and an unknown command are not (redis-py's ``AuthenticationError`` is a
    ``ConnectionError``, and is told apart here)."""
    if isinstance(err, redis.AuthenticationError | redis.exceptions.NoPermissionError):
        return False
    if isinstance(err, redis.ConnectionError | redis.TimeoutError | redis.BusyLoadingError
                  | redis.ReadOnlyError):
        return True
    text = str(err)
    return text.startswith(("MISCONF", "OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN",
                            "LOADING", "BUSY"))


def refusal(err: redis.RedisError, url: str) -> str:
    """The one line for a refusal waiting cannot fix (``transient(err)`` is False), without
    the URL's password."""
    where = f"Redis at {safe_url(url)}"
    said = redact(" ".join(str(err).split()))
    first = urlsplit(url.split(";")[0])
    user = unquote(first.username) if first.username else None
    who = f"user {user!r}" if user else "the default user"
    if isinstance(err, redis.AuthenticationError) and not first.password:
        return (f"{where} requires a password (NOAUTH: {said}): put it in DEX_REDIS_URL "
                "(redis://:PASSWORD@host:port/0, or redis://USER:PASSWORD@host:port/0 for an "
                "ACL user)")
    if isinstance(err, redis.AuthenticationError):
        return (f"{where} refused the password of {who} ({said}): check the user name and "
                "password in DEX_REDIS_URL (redis://USER:PASSWORD@host:port/0) against the "
                "server's requirepass or ACL users")
    if isinstance(err, redis.exceptions.NoPermissionError):
        return (f"{where} refused a command to {who} (NOPERM {said}): give that user the "
                f"commands, keys and channels dex-tasks uses (ACL SETUSER {user or 'default'} "
                "... : docs/deploying.md lists them)")
    if isinstance(err, redis.exceptions.InvalidResponse):
        return (f"{where} answers, but not as Redis does ({said}): check the host and port "
                "in DEX_REDIS_URL (rediss:// for a Redis that only speaks TLS)")
    if "unknown command" in said.lower():
        return (f"{where} does not know a command dex-tasks needs ({said}): use Redis 6.2 or "
                "later, without rename-command for the commands docs/deploying.md lists")
    return f"{where} refused dex-tasks ({said}): see docs/deploying.md"


def check_redis(client: redis.Redis, commands: Sequence[Command]) -> None:
    """One try: connect (authenticating), then queue ``commands`` inside ``MULTI`` and
    discard them, all sent at once (one round trip). Raises what Redis answered: the first
    refusal of a command, or the error of the connection."""
    # (Any: redis-py's Connection methods are untyped.)
    conn: Any = client.connection_pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("MULTI",), *commands, ("DISCARD",)]))
        refused: redis.RedisError | None = None
        for _ in range(len(commands) + 2):
            try:
                conn.read_response()
            except redis.ResponseError as err:
                # SUBSCRIBE is refused inside MULTI once the ACL let it through: that is no
                # refusal of ours. Every answer is read, so DISCARD's is the last.
                if refused is None and "not allowed" not in str(err).lower():
                    refused = err
    finally:
        # Never handed back: a connection in MULTI, or with answers unread, is of no use.
        conn.disconnect()
        client.connection_pool.release(conn)
    if refused is not None:
        raise refused


def until_redis_answers(settings: DexSettings, role: str, *,
                        wait: float | None = None,
                        clock: Callable[[], float] = time.monotonic) -> None:
    """Wait until Redis answers and lets a process of ``role`` (``client``, ``beat``,
    ``worker``) run every command it needs.

    While it is not answering (:func:`transient`), one WARNING line per try says so, with
    the URL (no password), the cause and how long it has been; ``wait`` (seconds; default:
    for ever, as Celery waits for its broker) bounds that, after which the last error is
    raised. A refusal raises :class:`BrokerRefusedError` at once.
    """
    commands = ROLES[role]
    started = clock()
    pause = FIRST_PAUSE_SECONDS
    tries = 0
    while True:
        client = redis_client(settings, socket_timeout=CHECK_TIMEOUT_SECONDS,
                              socket_connect_timeout=CHECK_TIMEOUT_SECONDS)
        try:
            check_redis(client, commands)
            if tries:
                log.info(f"Redis at {safe_url(settings.redis_url)} answers",
                         extra={"action": "startup_redis_ready",
                                "waited": f"{clock() - started:.0f}s"})
            return
        except redis.RedisError as err:
            if not transient(err):
                raise BrokerRefusedError(refusal(err, settings.redis_url)) from None
            elapsed = clock() - started
            if wait is not None and elapsed + pause > wait:
                raise
            tries += 1
            log.warning(
                f"Redis at {safe_url(settings.redis_url)} is not answering "
                f"({redact(' '.join(str(err).split()))}); trying again in {pause:.0f} s "
                f"({elapsed:.0f} s so far)",
                extra={"action": "startup_redis_wait", "attempt": tries,
                       "waiting_for": f"{elapsed:.0f}s"})
        finally:
            client.close()
        time.sleep(pause)
        pause = min(pause * 2, MAX_PAUSE_SECONDS)


def refuse_if_refused(settings: DexSettings, role: str, *, timeout: float) -> None:
    """One try of :func:`until_redis_answers`'s check, for processes that must not wait for
    Redis (an agent's ``DexClient``, the API: a Redis that is down only makes their calls
    end "did not run" until it is back): :class:`BrokerRefusedError` if Redis refuses the
    password or a command, nothing otherwise."""
    client = redis_client(settings, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        check_redis(client, ROLES[role])
    except redis.RedisError as err:
        if not transient(err):
            raise BrokerRefusedError(refusal(err, settings.redis_url)) from None
        log.debug("Redis is not answering at start", extra={"action": "startup_redis_down"})
    finally:
        client.close()
