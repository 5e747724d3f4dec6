"""A Redis transport that reuses one Redis client per channel.

kombu's Redis channel builds a new ``redis.Redis`` client object for every synchronous command
it sends (``Channel.conn_or_acquire``): each message published, and in a worker's main process
each message received (its write to the unacked set) and each ack (its removal from there).
The client shares the channel's connection pool, so nothing is gained by rebuilding it, and the
build costs about 50 µs of CPU (redis-py 8 checks its deprecated arguments on every
``Redis.__init__``): about a fifth of ``call_tool``'s time, and about a tenth of a worker main
process's CPU per call. A ``redis.Redis`` client is safe to share between threads (its pool
hands each command its own connection). Used by every app dex-tasks builds (see
``create_app``), on every kind of broker URL: :class:`Transport` for ``redis://`` and
``rediss://``, :class:`SentinelTransport` for ``sentinel://``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import monotonic
from typing import Any

from kombu.transport import redis as kombu_redis


class _OneClient:
    """Mixin for kombu Redis channels: synchronous commands share one client object."""

    _dex_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._dex_client is None:
            self._dex_client = self._create_client()  # type: ignore[attr-defined]
        yield self._dex_client


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


class _CheapBRPOP:
    """Mixin for kombu Redis channels: the consumer's ``BRPOP`` packed from cached pieces.

    A worker sends ``BRPOP`` over every queue it consumes again after each message it
    receives (kombu rotates the queue it served last to the end, for fairness). kombu builds
    the key list queue by queue and redis-py packs it argument by argument, growing one
    buffer: for a worker serving 500 tools (an MCP server's catalog) that was ~0.5 ms of the
    main process's CPU per message, about a sixth of a call's, growing with the catalog.
    Here each queue's RESP piece is encoded once and the command is one join, in kombu's
    order. Only the plain case is taken over: one priority step (``create_app`` sets it) and
    no global key prefix; anything else is kombu's own ``_brpop_start``.
    """

    _dex_pieces: dict[str, bytes] | None = None

    def _brpop_start(self, timeout: float | None = None) -> None:
        if self.priority_steps != [0] or self.global_keyprefix:  # type: ignore[attr-defined]
            super()._brpop_start(timeout)  # type: ignore[misc]
            return
        if timeout is None:
            timeout = self.brpop_timeout  # type: ignore[attr-defined]
        queues = self._queue_cycle.consume(len(self.active_queues))  # type: ignore[attr-defined]
        if not queues:
            return
        pieces = self._dex_pieces
        if pieces is None:
            pieces = self._dex_pieces = {}
        chunks = []
        for queue in queues:
            chunk = pieces.get(queue)
            if chunk is None:
                chunk = pieces[queue] = _bulk(queue.encode())
            chunks.append(chunk)
        tail = _bulk(repr(timeout or 0).encode())
        command = b"*%d\r\n%s%s%s" % (len(chunks) + 2, _bulk(b"BRPOP"), b"".join(chunks), tail)
        # The rest as kombu's _brpop_start (5.7) does it.
        self._in_poll = self.client.connection  # type: ignore[attr-defined]
        self._brpop_sent_at = monotonic()
        # A list of buffers, as redis-py's own packer hands over (bytes would be iterated).
        self.client.connection.send_packed_command([command])  # type: ignore[attr-defined]


class Channel(_CheapBRPOP, _OneClient, kombu_redis.Channel):  # type: ignore[misc]
    """A Redis channel whose synchronous commands share one client object."""


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


class SentinelChannel(_CheapBRPOP, _OneClient, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """A Sentinel channel whose synchronous commands share one client object.

    The client's pool asks the Sentinels for the master on every new connection, so after a
    failover the shared client reaches the new master like a fresh one would.
    """


class SentinelTransport(kombu_redis.SentinelTransport):  # type: ignore[misc]
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel
