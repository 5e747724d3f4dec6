"""How calls reach workers: one queue per tool, and which tools the live workers serve.

Every call is published to its tool's queue (:func:`queue_for`), and a worker consumes the
queues of the tools it serves, so a call waits for a worker that can run it instead of being
taken by one that cannot (a rolling deploy, or pools with different tool sets). A worker may
serve only some of the tools it imports (``dex-tasks worker --serve``): I/O-bound tools on a
``threads`` worker, CPU-bound ones on ``prefork``.

Each worker's main process announces itself in Redis every ``DEX_WORKER_HEARTBEAT_SECONDS``
(:class:`Presence`): the tools it serves, and the delivery tags of the messages it holds
(reserved, running, or waiting out a retry's countdown). Both keys expire after
:data:`MISSED_BEATS` missed beats, so Redis alone tells which tools have a live worker and
which held messages belong to a worker that is gone (``sweeps.expire_unserved`` and
``sweeps.restore_orphaned_messages`` act on them). Redis's own clock runs those expiries: the
machines' clocks never need to agree.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Iterable
from typing import Any

import redis
from celery import Celery
from celery.worker import state as worker_state

from dex_tasks.errors import ConfigurationError

log = logging.getLogger("dex_tasks.broker.routing")

# Every queue dex-tasks publishes to starts with this (the tools' and the reconcile queue).
DEX_QUEUE_PREFIX = "dex."
TOOL_QUEUE_PREFIX = "dex.tool."
# Tool names are free text (``limits.check_id``); queue names also travel in kombu's binding
# entries, which are split on a control-character separator. Names outside this set get a
# readable prefix plus a hash, which keeps the mapping one-to-one.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,100}")

WORKER_KEY = "dex:worker:"
HELD_KEY = "dex:held:"
# A single-attempt call's Redis claim is CLAIM_KEY + its idempotency key (worker/claims.py
# takes it; the notifier shortens it once the call has ended).
CLAIM_KEY = "dex:claim:"
# A worker whose keys were not refreshed for this many beats counts as gone.
MISSED_BEATS = 5


def queue_for(tool: str) -> str:
    """The queue the calls of ``tool`` are published to (the same in every process)."""
    if _PLAIN_NAME.fullmatch(tool):
        return TOOL_QUEUE_PREFIX + tool
    readable = re.sub(r"[^A-Za-z0-9_.:@-]", "_", tool)[:60]
    digest = hashlib.sha256(tool.encode("utf-8")).hexdigest()[:16]
    return f"{TOOL_QUEUE_PREFIX}{readable}-{digest}"


class ServeSelectionError(ConfigurationError):
    """A ``--serve`` pattern names no imported tool (the message names it and the choices)."""


def select_tools(available: Iterable[str], serve: str | None) -> list[str]:
    """The tools a worker serves: every one of ``available``, or those matching ``serve``.

    ``serve`` is comma-separated tool names or shell-style patterns (``http_*``). A pattern
    that matches nothing raises :class:`ServeSelectionError`: a typo would otherwise leave a
    tool without a worker until its calls reach their queue deadline.
    """
    names = sorted(set(available))
    if not serve or not serve.strip():
        return names
    chosen: set[str] = set()
    for pattern in (p.strip() for p in serve.split(",")):
        if not pattern:
            continue
        matched = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ServeSelectionError(
                f"--serve {pattern!r} matches none of the imported tools: "
                f"{', '.join(names) or '(none)'}"
            )
        chosen.update(matched)
    return sorted(chosen)


def presence_ttl(heartbeat_seconds: float) -> int:
    """How long (whole seconds) a worker's announcement outlives its last beat."""
    return max(1, math.ceil(heartbeat_seconds * MISSED_BEATS))


def live_tools(client: redis.Redis) -> set[str]:
    """The tools at least one live worker serves (from their unexpired announcements)."""
    return {name for record in live_workers(client) for name in record.get("tools", ())}


def live_workers(client: redis.Redis) -> list[dict[str, Any]]:
    """The announcement records of the live workers (node, host, pid, pool, concurrency,
    tools), by node name."""
    keys = sorted(client.scan_iter(match=WORKER_KEY + "*", count=1000))
    records = client.mget(keys) if keys else []
    return [json.loads(_text(r)) for r in records if r is not None]


def announcement(client: redis.Redis, node: str) -> dict[str, Any] | None:
    """The live announcement of the worker named ``node`` (its host, pid, pool, tools), if
    there is one."""
    raw = client.get(WORKER_KEY + node)
    if raw is None:
        return None
    try:
        record = json.loads(_text(raw))
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def announcements_complete(client: redis.Redis, heartbeat_seconds: float) -> bool:
    """False while Redis has been up for less than a worker's announcement lasts: after a
    restart that lost (or expired) the announcements, live workers have not all announced
    themselves again yet, and a tool may look unserved when it is not."""
    try:
        uptime = float(client.info("server")["uptime_in_seconds"])
    except (redis.ResponseError, KeyError, ValueError):
        return True  # INFO refused (a managed Redis): rely on the announcements alone
    return uptime >= presence_ttl(heartbeat_seconds)


def held_tags(client: redis.Redis) -> set[str]:
    """Delivery tags of the messages that live workers hold."""
    held: set[str] = set()
    for key in client.scan_iter(match=HELD_KEY + "*", count=1000):
        held.update(_text(tag) for tag in client.smembers(key))
    return held


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def worker_record(node: str, tools: Iterable[str], *, pool: str, concurrency: int) -> str:
    """A worker's announcement (``WORKER_KEY + node``): who it is and the tools it serves."""
    return json.dumps({"node": node, "host": socket.gethostname(), "pid": os.getpid(),
                       "pool": pool, "concurrency": concurrency, "tools": sorted(tools)})


def _held_by_this_worker() -> list[str]:
    tags = []
    # Reserved, running and countdown-waiting requests alike: each holds an unacked message.
    for request in list(worker_state.requests.values()):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag:
            tags.append(str(tag))
    return tags


class Presence(threading.Thread):
    """Announces a worker in Redis: its tools and the messages it holds, every beat.

    Runs in the worker's main process (which sees every request, whatever the pool), beside
    the lease renewer. One pipeline per beat: the worker's record (its served tools in it) and
    the set of held delivery tags, both with the same expiry.
    """

    def __init__(self, client: redis.Redis, node: str, tools: Iterable[str], pool: str,
                 concurrency: int, heartbeat_seconds: float) -> None:
        super().__init__(name="dex-presence", daemon=True)
        # A client of redis_clients.redis_client: the master through the Sentinels, TLS. (A
        # client made from the URL failed on sentinel:// URLs, so such workers never
        # announced themselves and their tools looked unserved.)
        self.client = client
        self.node = node
        self.tools = sorted(tools)
        self.interval = heartbeat_seconds
        self.ttl = presence_ttl(heartbeat_seconds)
        self.record = worker_record(node, self.tools, pool=pool, concurrency=concurrency)
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.beat_once()
            except Exception as err:  # noqa: BLE001 - Redis down: try again next beat
                log.warning("worker heartbeat failed: %s", err,
                            extra={"action": "heartbeat_error", "node": self.node})
            if self.stopped.wait(self.interval):
                return

    def beat_once(self) -> None:
        """Refresh this worker's keys once."""
        held = _held_by_this_worker()
        pipe = self.client.pipeline(transaction=True)
        # One key for the worker and its tools, whatever their number: a key per tool cost a
        # catalog of 500 tools 250 commands a second per idle worker.
        pipe.set(WORKER_KEY + self.node, self.record, ex=self.ttl)
        key = HELD_KEY + self.node
        pipe.delete(key)
        if held:
            pipe.sadd(key, *held)
            pipe.expire(key, self.ttl)
        pipe.execute()


def restore_orphans(app: Celery, held: set[str], received_before: float,
                    limit: int = 1000) -> int:
    """Hand back to their queues the dex-tasks messages that sit in kombu's ``unacked`` hash
    since before ``received_before`` and that no live worker holds; returns how many.

    These are the messages of a worker that vanished: reserved but not started, running
    (late-acked), or waiting out a retry's countdown. kombu would restore them only after the
    visibility timeout. The restore is kombu's own (``QoS.restore_by_tag``: one optimistic
    transaction that moves the message back only if it is still unacked), so a message acked
    meanwhile is left alone. Messages of other Celery apps on the same Redis are never
    touched. A worker that is alive but missed its beats gets a duplicate delivery, which the
    store's claim turns away.
    """
    restored = 0
    with app.connection_for_write() as conn:
        if conn.transport.driver_type != "redis":
            return 0
        channel = conn.default_channel
        client = channel.client
        old = client.zrangebyscore(channel.unacked_index_key, "-inf", received_before,
                                   start=0, num=limit)
        for raw in old:
            tag = _text(raw)
            if tag in held or not _is_ours(client.hget(channel.unacked_key, tag)):
                continue
            channel.qos.restore_by_tag(tag, client=client)
            restored += 1
            log.info("message of a lost worker restored to its queue",
                     extra={"action": "message_restored", "tag": tag})
    return restored


def _is_ours(entry: bytes | None) -> bool:
    """True for an unacked entry (``[payload, exchange, routing key]``) bound for a dex-tasks
    queue."""
    if entry is None:
        return False
    try:
        _, _, routing_key = json.loads(entry)
    except (ValueError, TypeError):
        return False
    return isinstance(routing_key, str) and routing_key.startswith(DEX_QUEUE_PREFIX)


# kombu's hash of the messages workers received and have not acknowledged (its default name).
UNACKED_KEY = "unacked"
# A queue longer than this is not searched: a call's message may well be waiting in it.
SEARCH_QUEUE_LIMIT = 1000


class MessageSearch:
    """Whether Redis still holds a queued call's message: in its queue, or in kombu's unacked
    hash (received by a worker, not acknowledged). Each is read at most once per search.

    A message that a worker's ``BRPOP`` took off its queue just as a partition cut that worker
    off is in neither: Redis removed it and the worker never got it (kombu records a message
    as unacked only once it has arrived). Only a republish brings such a call back. A message
    is found by its call's key, which Celery writes in plain text in its headers (``argsrepr``).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._unacked: list[bytes] | None = None
        self._queues: dict[str, list[bytes] | None] = {}

    def holds(self, queue: str, key: str) -> bool:
        """True unless the call's message is surely gone (a long queue counts as holding)."""
        needle = key.encode()
        try:
            if self._unacked is None:
                self._unacked = [_raw(v) for v in self.client.hvals(UNACKED_KEY)]
            if any(needle in entry for entry in self._unacked):
                return True
            if queue not in self._queues:
                length = int(self.client.llen(queue))
                self._queues[queue] = (None if length > SEARCH_QUEUE_LIMIT else
                                       [_raw(m) for m in self.client.lrange(queue, 0, -1)])
        except redis.RedisError:
            return True  # cannot tell: the republisher's window applies
        messages = self._queues[queue]
        return messages is None or any(needle in m for m in messages)


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")
