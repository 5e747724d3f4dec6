"""Every Redis connection dex-tasks makes, configured in one place: plain, TLS or Sentinel.

``DEX_REDIS_URL`` takes three forms:

* ``redis://[user:password@]host:port/db``: one Redis server;
* ``rediss://...``: the same over TLS. The server's certificate is always verified (against
  ``DEX_REDIS_TLS_CA_FILE``, else the system's CAs) and its name checked; a client
  certificate (``DEX_REDIS_TLS_CERT_FILE`` / ``_KEY_FILE``) is sent when one is set;
* ``sentinel://[user:password@]host:port/db;sentinel://host:port;...``: Redis Sentinel. The
  Sentinels are asked which server is the master of ``DEX_REDIS_SENTINEL_MASTER``; after a
  failover every connection finds the new master the same way. The credentials and database
  of the first address are those of the master (Sentinels are reached without a password).

Celery's broker (kombu) and the clients dex-tasks makes itself (claims, sweep locks, sweep
statistics for metrics) are both configured from here, so they always agree on where Redis is
and how to reach it. kombu on its own would accept ``rediss://`` without verifying the
server's certificate (it logs a warning and uses ``CERT_NONE``): :func:`broker_options`
never leaves that to it.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from dex_tasks.errors import ConfigurationError
from dex_tasks.settings import DexSettings

SCHEMES = ("redis", "rediss", "sentinel")


@dataclass(frozen=True)
class RedisTarget:
    """``DEX_REDIS_URL`` taken apart: what to connect to, and how."""

    scheme: str
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def sentinel(self) -> bool:
        return self.scheme == "sentinel"


def target(settings: DexSettings) -> RedisTarget:
    """Parse and check ``DEX_REDIS_URL``; :class:`ConfigurationError` names what is wrong."""
    url = settings.redis_url.strip()
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"DEX_REDIS_URL must start with redis://, rediss:// (TLS) or sentinel://, got "
            f"{safe_url(url)!r}"
        )
    if not scheme == "sentinel":
        if settings.redis_sentinel_master:
            raise ConfigurationError(
                "DEX_REDIS_SENTINEL_MASTER is set but DEX_REDIS_URL is not a sentinel:// URL"
            )
        _check_tls_files(settings, scheme)
        return RedisTarget(scheme=scheme, url=url)
    if not settings.redis_sentinel_master:
        raise ConfigurationError(
            "DEX_REDIS_URL names Redis Sentinels, so DEX_REDIS_SENTINEL_MASTER must name the "
            "master they monitor (the name in their `sentinel monitor` line)"
        )
    _check_tls_files(settings, scheme)
    sentinels: list[tuple[str, int]] = []
    first = None
    for part in url.split(";"):
        if not part.strip():
            continue
        parsed = urlsplit(part.strip())
        if parsed.scheme.lower() != "sentinel" or not parsed.hostname:
            raise ConfigurationError(
                "DEX_REDIS_URL with Sentinels must be sentinel://host:port entries separated "
                f"by ';', got {safe_url(part)!r}"
            )
        try:
            port = parsed.port or 26379
        except ValueError as err:
            raise ConfigurationError(f"DEX_REDIS_URL: {err} in {safe_url(part)!r}") from None
        sentinels.append((parsed.hostname, port))
        first = first or parsed
    assert first is not None
    db_text = first.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigurationError(
            f"DEX_REDIS_URL: the database must be a number, got {db_text!r}"
        )
    return RedisTarget(
        scheme=scheme, url=url, sentinels=tuple(sentinels),
        master=settings.redis_sentinel_master, db=int(db_text),
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password else None,
    )


def _check_tls_files(settings: DexSettings, scheme: str) -> None:
    files = {"DEX_REDIS_TLS_CA_FILE": settings.redis_tls_ca_file,
             "DEX_REDIS_TLS_CERT_FILE": settings.redis_tls_cert_file,
             "DEX_REDIS_TLS_KEY_FILE": settings.redis_tls_key_file}
    given = [name for name, value in files.items() if value]
    if given and scheme != "rediss":
        # Certificates configured for a plain connection: the operator meant TLS.
        raise ConfigurationError(
            f"{', '.join(given)} set, but DEX_REDIS_URL is not a rediss:// URL (TLS); "
            "Sentinel over TLS is not supported"
        )
    if bool(settings.redis_tls_cert_file) != bool(settings.redis_tls_key_file):
        raise ConfigurationError(
            "DEX_REDIS_TLS_CERT_FILE and DEX_REDIS_TLS_KEY_FILE go together: set both or neither"
        )


def tls_options(settings: DexSettings) -> dict[str, Any]:
    """redis-py's TLS arguments (kombu passes the same dict to its connections)."""
    options: dict[str, Any] = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}
    if settings.redis_tls_ca_file:
        options["ssl_ca_certs"] = settings.redis_tls_ca_file
    if settings.redis_tls_cert_file:
        options["ssl_certfile"] = settings.redis_tls_cert_file
        options["ssl_keyfile"] = settings.redis_tls_key_file
    return options


def broker_options(settings: DexSettings) -> dict[str, Any]:
    """Celery settings that make its broker connection match ``DEX_REDIS_URL``.

    ``broker_transport_options`` here are additions to the app's own. The transports are
    those of ``transport.py``, which reuse one Redis client per channel, for every app:
    publishers (``DexClient``, beat) and workers alike (a worker's main process builds one
    for each message's unacked-set write and another for its ack otherwise).
    """
    where = target(settings)
    options: dict[str, Any] = {"broker_transport_options": {}}
    if where.sentinel:
        options["broker_transport_options"]["master_name"] = where.master
        options["broker_transport"] = "dex_tasks.broker.transport:SentinelTransport"
    else:
        options["broker_transport"] = "dex_tasks.broker.transport:Transport"
    if where.tls:
        options["broker_use_ssl"] = tls_options(settings)
    return options


# TCP keepalives on every Redis socket dex-tasks opens: probes after 5 s idle, every 2 s, 3
# missed = dead, and data unacknowledged for 10 s ends the connection (TCP_USER_TIMEOUT). An
# idle pooled connection to a Redis a partition cut off is then found dead in about 11 s
# instead of the kernel's 2 hours. Linux names; other systems get redis-py's defaults.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT, USER_TIMEOUT_MS = 5, 2, 3, 10_000


def keepalive_options() -> dict[int, int]:
    """``socket_keepalive_options`` for redis-py and kombu (see :data:`KEEPALIVE_IDLE`)."""
    wanted = {"TCP_KEEPIDLE": KEEPALIVE_IDLE, "TCP_KEEPINTVL": KEEPALIVE_INTERVAL,
              "TCP_KEEPCNT": KEEPALIVE_COUNT, "TCP_USER_TIMEOUT": USER_TIMEOUT_MS}
    return {getattr(socket, name): value for name, value in wanted.items()
            if hasattr(socket, name)}


def health_options(settings: DexSettings) -> dict[str, Any]:
    """What keeps a pooled Redis connection from failing the first command after a network
    heal: keepalives (:func:`keepalive_options`), and a PING before a command on a connection
    idle ``DEX_REDIS_HEALTH_CHECK_SECONDS``, which reconnects a dead one instead of failing
    (issue 19, P2: ``Broken pipe`` on the first claim after a heal)."""
    return {"socket_keepalive": True, "socket_keepalive_options": keepalive_options(),
            "health_check_interval": settings.redis_health_check_seconds}


def redis_client(
    settings: DexSettings, *, socket_timeout: float = 10.0,
    socket_connect_timeout: float | None = None,
) -> redis.Redis:
    """A Redis client for ``DEX_REDIS_URL``: the master, through the Sentinels if they are
    configured, over TLS for ``rediss://``. Its connections are made on first use, keep TCP
    keepalives and are health-checked (:func:`health_options`)."""
    where = target(settings)
    timeouts: dict[str, Any] = {"socket_timeout": socket_timeout,
                                "socket_connect_timeout": socket_connect_timeout,
                                **health_options(settings)}
    if where.sentinel:
        assert where.master is not None
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(where.sentinels), sentinel_kwargs=dict(timeouts), **timeouts)
        client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
            where.master, db=where.db, username=where.username, password=where.password,
            **timeouts,
        )
        return client
    extra = tls_options(settings) if where.tls else {}
    return redis.Redis.from_url(where.url, **timeouts, **extra)


def safe_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages."""
    out = []
    for part in url.split(";"):
        try:
            parsed = urlsplit(part)
            password = parsed.password
        except ValueError:
            password = None
        if password:
            part = part.replace(f":{password}@", ":***@", 1)
        out.append(part)
    return ";".join(out)


CommandArg: TypeAlias = str | bytes | int | float
"""An argument of a command :func:`pack_command` packs (what redis-py accepts, less the
buffers)."""


def pack_command(*args: CommandArg) -> bytes:
    """``args`` as one command of the Redis protocol (an array of bulk strings), each encoded
    as redis-py's clients encode them: text as UTF-8, numbers by ``repr``, bytes as they are.

    For :func:`send_packed`. Cheaper than redis-py's own packing (its ``Encoder``'s type
    checks, then a bytes object built again for each argument): a worker child packs a
    command of about twenty arguments for each call it ends (``announce.py``).
    """
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif not isinstance(arg, bytes):
            if isinstance(arg, bool) or not isinstance(arg, (int, float)):
                # redis-py refuses these too: True would be sent as "True", not 1.
                raise redis.DataError(f"Invalid input of type: {type(arg).__name__!r}")
            arg = repr(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def send_packed(client: redis.Redis, command: bytes) -> Any:
    """Run one command that :func:`pack_command` packed on a connection of ``client``'s pool
    and return its reply, as ``client.execute_command`` would; an error reply raises its
    ``ResponseError`` (``NoScriptError``, ``NoPermissionError``...).

    The same connection handling as ``execute_command`` (the pool's connection, its health
    check, the client's ``Retry`` for connection errors, which closes the connection before
    each new try, the connection closed on any other failure but an error reply), less the
    work of redis-py's that a command sent many times a second does not need: its packing
    (see :func:`pack_command`), its response callbacks (none for the commands sent so here:
    ``EVALSHA``'s reply is the script's) and its own OpenTelemetry metrics of the command,
    which dex-tasks does not turn on. About a third of the client's CPU of an ``EVALSHA``
    of twenty arguments (issue 29).

    Not for a client made with ``single_connection_client``, which no client of dex-tasks
    is: this takes a connection from the pool regardless.
    """
    pool = client.connection_pool
    conn: Any = pool.get_connection()  # (redis-py's Connection is partly untyped)
    try:
        return conn.retry.call_with_retry(
            lambda: _round_trip(conn, command),
            # A connection error: the next try reconnects (send_packed_command does). (The
            # two-argument form: redis-py before 7 has no ``with_failure_count``.)
            lambda _error: conn.disconnect())
    except redis.ResponseError:
        raise  # the reply was read whole: the connection is ready for the next command
    except BaseException:
        # Anything else may have left a reply unread on the connection (an interrupt between
        # the send and the read): never hand it to the next command.
        conn.disconnect()
        raise
    finally:
        # A server that announced maintenance asks for a new connection (redis-py 8's
        # ``should_reconnect``), which execute_command makes before giving this one back.
        if getattr(conn, "should_reconnect", lambda: False)():
            conn.disconnect()
        pool.release(conn)


def send_script(client: redis.Redis, script: str, command: bytes) -> Any:
    """:func:`send_packed` of ``command``, an ``EVALSHA`` of ``script``, which is loaded and
    the command sent again when this server does not have it (first use, a restart, a
    failover): the script fails before it runs a command, so sending it again repeats
    nothing."""
    try:
        return send_packed(client, command)
    except redis.exceptions.NoScriptError:
        client.script_load(script)
        return send_packed(client, command)


class Pending:
    """A command that :func:`pack_command` packed, sent on a connection of ``client``'s pool
    whose reply is read later (:meth:`reply`): the caller does other work, another server's
    round trip, while Redis runs it.

    Sent once, without the client's ``Retry`` (a command that failed to be sent did not run;
    one whose reply was lost may have). The connection goes back to the pool once the reply
    is read (:meth:`reply`) or dropped (:meth:`drop`): one of them must be called. Not for a
    client made with ``single_connection_client`` (as :func:`send_packed`).
    """

    __slots__ = ("_conn", "_pool")

    def __init__(self, client: redis.Redis, command: bytes) -> None:
        self._pool = client.connection_pool
        conn: Any = self._pool.get_connection()
        self._conn: Any = conn
        try:
            conn.send_packed_command([command])
        except BaseException:
            self.drop()
            raise

    def reply(self) -> Any:
        """The command's reply (an error reply raises its ``ResponseError``). Anything else
        raised closes the connection: a reply may be left unread on it."""
        conn = self._conn
        if conn is None:
            raise redis.ConnectionError("the reply was dropped")
        try:
            return conn.read_response()
        except redis.ResponseError:
            raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._release()

    def drop(self) -> None:
        """Give the connection up without its reply (it is closed: the reply may come)."""
        if self._conn is not None:
            self._conn.disconnect()
            self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        # As send_packed: a server that announced maintenance asks for a new connection.
        if getattr(conn, "should_reconnect", lambda: False)():
            conn.disconnect()
        self._pool.release(conn)


def _round_trip(conn: Any, command: bytes) -> Any:
    conn.send_packed_command([command])
    return conn.read_response()


def connector(settings: DexSettings) -> Callable[[float], redis.Redis]:
    """``connect(timeout)``: a :func:`redis_client` with that socket and connect timeout (what
    the end-of-call notifications and their waiters connect with)."""

    def connect(timeout: float) -> redis.Redis:
        return redis_client(settings, socket_timeout=timeout, socket_connect_timeout=timeout)

    return connect
