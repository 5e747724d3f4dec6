"""Commands packed and sent without redis-py's per-command machinery (``redis_clients``
``pack_command`` and ``send_packed``, what a worker child's announcement and lease use) mean
to Redis and to the client exactly what ``execute_command`` would have."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from dex_tasks.broker.redis_clients import pack_command, send_packed
from tests.helpers import free_port


def test_a_packed_command_is_the_bytes_redis_py_would_send() -> None:
    # Given arguments of every type a command of dex-tasks sends: text (not ASCII too),
    # bytes, integers, floats, empty text
    args = ("EVALSHA", "dex:ended:s1/t/é", b"\x00raw", 0, -3, 60, 0.013246, 1e-7, 2.5e20, "")

    # When they are packed
    packed = pack_command(*args)

    # Then the bytes are redis-py's own packing of them
    conn = redis.Connection()
    assert packed == b"".join(conn.pack_command(*args))


@pytest.mark.parametrize("arg", [True, None, [1]], ids=["bool", "none", "list"])
def test_what_redis_py_refuses_to_send_is_refused(arg: object) -> None:
    with pytest.raises(redis.DataError):
        pack_command("SET", "k", arg)  # type: ignore[arg-type]


def test_a_sent_command_replies_as_execute_command_would(redis_url: str) -> None:
    # Given a client, plain and decoding its replies
    for decode in (False, True):
        client = redis.Redis.from_url(redis_url, decode_responses=decode)
        try:
            script = "return {ARGV[1], tonumber(ARGV[2]) + 1, redis.call('SET', KEYS[1], 'v')}"
            sha = client.script_load(script)
            args = ("EVALSHA", sha, 1, "packed:k", "é", 41)

            # When a command is sent packed, and the same with execute_command
            sent = send_packed(client, pack_command(*args))

            # Then the replies are the same
            assert sent == client.execute_command(*args)
            assert sent[1] == 42
        finally:
            client.close()


def test_an_error_reply_raises_and_leaves_the_connection_usable(redis_url: str) -> None:
    # Given a client with one pooled connection
    client = redis.Redis.from_url(redis_url)
    try:
        assert send_packed(client, pack_command("PING")) == b"PONG"
        pool = client.connection_pool
        # When a command gets an error reply (a script Redis does not have)
        with pytest.raises(redis.exceptions.NoScriptError):
            send_packed(client, pack_command("EVALSHA", "0" * 40, 0))

        # Then the error is redis-py's, and the same connection, back in the pool and still
        # connected, serves the next command
        assert len(pool._available_connections) == 1  # (redis-py's pool, read for the test)
        conn = pool._available_connections[0]
        assert conn._sock is not None
        assert send_packed(client, pack_command("ECHO", "next")) == b"next"
        assert pool._available_connections == [conn]
    finally:
        client.close()


def test_a_redis_that_is_down_raises_a_connection_error_and_keeps_no_connection() -> None:
    # Given a client of a port nothing listens on, which does not retry
    client = redis.Redis(port=free_port(), socket_connect_timeout=1)
    client.set_retry(Retry(NoBackoff(), 0))
    try:
        # When a command is sent
        with pytest.raises(redis.ConnectionError):
            send_packed(client, pack_command("PING"))

        # Then the connection went back to the pool, not left in use
        assert not client.connection_pool._in_use_connections
    finally:
        client.close()


def test_a_connection_redis_closed_is_retried_as_the_clients_retry_says(redis_url: str) -> None:
    # Given a client (redis-py's default Retry: connection errors tried again) whose pooled
    # connection Redis has closed since its last command
    client = redis.Redis.from_url(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        client_id = send_packed(client, pack_command("CLIENT", "ID"))
        admin.client_kill_filter(_id=client_id)

        # When the next command is sent on it
        reply = send_packed(client, pack_command("ECHO", "again"))

        # Then it was sent again on a new connection, as execute_command does
        assert reply == b"again"
        assert send_packed(client, pack_command("CLIENT", "ID")) != client_id
    finally:
        client.close()
        admin.close()
