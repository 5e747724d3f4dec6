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


class Channel(_OneClient, kombu_redis.Channel):  # type: ignore[misc]
    """A Redis channel whose synchronous commands share one client object."""


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


class SentinelChannel(_OneClient, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """A Sentinel channel whose synchronous commands share one client object.

    The client's pool asks the Sentinels for the master on every new connection, so after a
    failover the shared client reaches the new master like a fresh one would.
    """


class SentinelTransport(kombu_redis.SentinelTransport):  # type: ignore[misc]
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel
