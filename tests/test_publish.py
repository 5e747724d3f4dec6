"""A call's message (issue 29): ``celery_app.publish`` builds and sends it with the two calls
Celery's ``send_task`` makes itself, skipping what ``send_task`` does for options a call never
has. These tests hold it to that: for every shape of call, the message a worker would take
from the queue is the one ``send_task`` sent before, field by field, from the agent's app and
from a worker's (whose registered tasks ``send_task`` took default options from).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.exceptions import OperationalError

from dex_tasks import DexSettings
from dex_tasks.broker.celery_app import (
    RUN_RETRYING,
    RUN_SINGLE_ATTEMPT,
    create_app,
    publish,
    soft_limit,
    task_name_for,
    tool_of_shadow,
)
from dex_tasks.broker.routing import queue_for
from dex_tasks.policy import EffectClass
from dex_tasks.store.models import ToolCallRow
from dex_tasks.tracing import SENT_AT, TRACEPARENT
from dex_tasks.worker.main_process import register_tasks
from tests.conftest import fast_settings
from tests.helpers import RedisServer, free_port

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# What differs between two messages of the same call by construction: the task's id (and the
# ids made from it), the time the message was made (a countdown's eta, the time to live left
# before an expiry, the publish time a traced message carries) and kombu's delivery tag.
PER_MESSAGE = {"id", "root_id", "correlation_id", "delivery_tag", "eta", "expiration", SENT_AT}


def send_task_reference(app: Celery, call: ToolCallRow, countdown: float | None) -> None:
    """The message as ``publish`` sent it before issue 29: ``app.send_task`` with its options."""
    settings: DexSettings = app.dex_settings  # type: ignore[attr-defined]
    name = task_name_for(EffectClass(call.effect))
    options: dict[str, Any] = {
        "queue": queue_for(call.tool), "retry": True,
        "retry_policy": {"max_retries": 1, "interval_start": 0,
                         "interval_step": settings.publish_timeout_seconds / 4,
                         "interval_max": settings.publish_timeout_seconds / 4},
        "shadow": f"{name}[{call.tool}]", "declare": []}
    if call.trace_context is not None:
        options["headers"] = {TRACEPARENT: call.trace_context, SENT_AT: time.time()}
    if countdown:
        options["countdown"] = countdown
    if call.expires_at is not None:
        options["expires"] = datetime.fromtimestamp(call.expires_at, tz=UTC)
    if call.time_limit:
        options["time_limit"] = call.time_limit
        options["soft_time_limit"] = soft_limit(call.time_limit)
    app.send_task(name, args=[call.key], **options)


def a_call(key: str, **fields: Any) -> ToolCallRow:
    now = time.time()
    values: dict[str, Any] = {
        "key": key, "session_id": "s", "turn_id": "t", "tool_call_id": key, "tool": "lookup",
        "arguments": "{}", "effect": "read", "requires_approval": False, "max_attempts": 3,
        "status": "queued", "created_at": now, "updated_at": now, **fields}
    return ToolCallRow.model_validate(values)


def taken(client: redis.Redis, call: ToolCallRow) -> dict[str, Any]:
    """The one message on the call's queue, decoded as a worker reads it (body included)."""
    queue = queue_for(call.tool)
    assert client.llen(queue) == 1, f"expected one message on {queue}"
    raw = client.lpop(queue)
    assert isinstance(raw, bytes)
    message: dict[str, Any] = json.loads(raw)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


def queued_keys(client: redis.Redis) -> list[str]:
    """The keys of the calls whose messages wait on the ``lookup`` tool's queue, in the order
    a worker takes them (kombu pushes on the left, a worker pops on the right)."""
    return [json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
            for raw in reversed(client.lrange(queue_for("lookup"), 0, -1))]


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` without what differs between two messages of the same call."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in PER_MESSAGE}
        return value

    stripped: dict[str, Any] = strip(message)
    return stripped


@pytest.fixture
def agent(redis_url: str, sqlite_url: str) -> Iterator[Celery]:
    """An agent's app (``DexClient``'s) on this test's Redis database."""
    built = create_app(fast_settings(redis_url, sqlite_url), publisher=True)
    yield built
    built.close()


@pytest.fixture
def queues(redis_url: str) -> Iterator[redis.Redis]:
    """A plain client of this test's Redis database, to look at the queues."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(params=["agent", "worker"])
def app(request: pytest.FixtureRequest, redis_url: str, sqlite_url: str) -> Iterator[Celery]:
    settings = fast_settings(redis_url, sqlite_url)
    # A worker's app has the task kinds registered, whose defaults send_task merged in.
    built = create_app(settings, publisher=request.param == "agent")
    if request.param == "worker":
        register_tasks(built)
    yield built
    built.close()


QUEUE_DEADLINE = 600.0
# Each shape of call: its fields (a queue deadline, ``expires_at``, set when the test runs),
# and the countdown it is sent with.
CALLS: dict[str, tuple[dict[str, Any], float | None]] = {
    "a read": ({}, None),
    "a single-attempt call": ({"effect": "non_idempotent_write", "max_attempts": 1}, None),
    "a retry after a countdown": ({}, 2.5),
    "a call with a queue deadline": ({"expires_at": QUEUE_DEADLINE}, None),
    "a call with a time limit": ({"time_limit": 30.0}, None),
    "a traced call": ({"trace_context": TRACE}, None),
}


@pytest.mark.parametrize("shape", list(CALLS))
def test_a_calls_message_is_the_one_send_task_sent(app: Celery, queues: redis.Redis,
                                                   shape: str) -> None:
    fields, countdown = CALLS[shape]
    if "expires_at" in fields:
        fields = {**fields, "expires_at": time.time() + fields["expires_at"]}
    # Given one call, sent once by send_task (as before) and once by publish
    call = a_call(f"k-{shape.replace(' ', '-')}", **fields)
    send_task_reference(app, call, countdown)
    before = taken(queues, call)
    publish(app, call, countdown=countdown)
    now = taken(queues, call)
    # Then a worker takes the same message from the queue, but for its id and the moment it
    # was made
    assert comparable(now) == comparable(before)
    headers = now["headers"]
    assert headers["id"] != before["headers"]["id"]
    assert headers["root_id"] == headers["id"] == now["properties"]["correlation_id"]
    assert headers["argsrepr"] == repr([call.key])
    assert now["body"][0] == [call.key]
    # And the parts that depend on that moment still say the same
    assert set(headers) == set(before["headers"])
    assert (headers["eta"] is None) == (before["headers"]["eta"] is None)
    if countdown:
        eta = datetime.fromisoformat(headers["eta"]).timestamp()
        assert abs(eta - (time.time() + countdown)) < 2.0
    if call.expires_at is not None:
        assert headers["expires"] == before["headers"]["expires"]
        # kombu writes the time to live left in milliseconds
        left = float(now["properties"]["expiration"])
        assert 590_000 < left <= 600_000
        assert abs(left - float(before["properties"]["expiration"])) < 5_000
    if call.trace_context is not None:
        assert headers[TRACEPARENT] == TRACE
        assert abs(float(headers[SENT_AT]) - time.time()) < 60


def test_the_tool_a_messages_shadow_name_names_is_read_back(app: Celery,
                                                           queues: redis.Redis) -> None:
    # Given calls of both task kinds, one whose tool name holds brackets of its own
    for effect, tool in (("read", "lookup"), ("non_idempotent_write", "refund[eu]")):
        call = a_call(f"k-shadow-{effect}", effect=effect, tool=tool)
        publish(app, call)
        # Then the tool read back from the message's shadow name is the call's
        assert tool_of_shadow(taken(queues, call)["headers"]["shadow"]) == tool
    # And a name that is not a call's names no tool
    for other in (None, "", RUN_RETRYING, f"{RUN_RETRYING}[]", f"{RUN_SINGLE_ATTEMPT}[x",
                  "dex.sweep[x]", "celery.chord_unlock"):
        assert tool_of_shadow(other) is None, other


def test_a_publish_to_an_unreachable_broker_raises_kombus_error_within_its_timeout(
    redis_url: str, sqlite_url: str
) -> None:
    # Given an agent's app whose broker is a port nothing listens on
    settings = fast_settings(f"redis://127.0.0.1:{free_port()}/0", sqlite_url,
                             publish_timeout_seconds=0.4)
    app = create_app(settings, publisher=True)
    try:
        started = time.monotonic()
        # When it publishes a call, then it raises kombu's error, as send_task did, and does
        # not hang past its retry policy
        with pytest.raises(OperationalError):
            publish(app, a_call("k-unreachable"))
        assert time.monotonic() - started < 5.0
    finally:
        app.close()


def connections_on(client: redis.Redis, db: str) -> int:
    """How many connections Redis has on database ``db`` (a test's own)."""
    return sum(1 for c in client.client_list() if str(c.get("db")) == db)


def test_an_agent_publishing_call_after_call_keeps_the_same_connections(
    agent: Celery, queues: redis.Redis, redis_url: str
) -> None:
    # Given an agent's app on a Redis database of its own, that has published once
    db = redis_url.rsplit("/", 1)[1]
    publish(agent, a_call("k-first"))
    opened = connections_on(queues, db)
    # When it publishes fifty more calls one after another
    for i in range(50):
        publish(agent, a_call(f"k-{i}"))
    # Then each is on the queue, and they went through the connections the first opened (the
    # producer it holds between publishes is neither lost nor taken anew)
    assert queued_keys(queues) == ["k-first", *(f"k-{i}" for i in range(50))]
    assert connections_on(queues, db) == opened


def test_publishes_from_many_threads_at_once_each_send_their_message(
    agent: Celery, queues: redis.Redis
) -> None:
    # Given an agent's app shared by eight threads (a server's request handlers)
    errors: list[BaseException] = []

    def send(n: int) -> None:
        try:
            for i in range(25):
                publish(agent, a_call(f"k-{n}-{i}"))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    # When they all publish at once (one holds the app's producer, the others take one from
    # the pool while it is in use)
    threads = [threading.Thread(target=send, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # Then every message is on the queue, once
    assert errors == []
    assert sorted(queued_keys(queues)) == sorted(f"k-{n}-{i}" for n in range(8)
                                                 for i in range(25))


def test_after_the_broker_restarts_the_next_publish_gets_through(sqlite_url: str) -> None:
    # Given an agent's app that has published through its own Redis
    server = RedisServer(free_port()).start()
    app = create_app(fast_settings(f"{server.url}/0", sqlite_url,
                                   publish_timeout_seconds=0.4), publisher=True)
    try:
        publish(app, a_call("k-first"))
        # When that Redis goes away, a publish fails with kombu's error
        server.stop()
        with pytest.raises(OperationalError):
            publish(app, a_call("k-while-down"))
        # Then once it is back (empty: it keeps nothing), the next publish gets through
        server.start()
        publish(app, a_call("k-after"))
        client = redis.Redis.from_url(f"{server.url}/0")
        try:
            assert queued_keys(client) == ["k-after"]
        finally:
            client.close()
    finally:
        app.close()
        server.cleanup()


def test_a_forked_child_publishes_on_a_connection_of_its_own(agent: Celery,
                                                             queues: redis.Redis) -> None:
    # Given an agent's app that has published (and holds a connection) before a fork
    publish(agent, a_call("k-parent-1"))
    # When a forked child publishes with the same app, and then the parent does again
    pid = os.fork()
    if pid == 0:  # the child: report by exit status, never by pytest
        code = 1
        try:
            publish(agent, a_call("k-child"))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    publish(agent, a_call("k-parent-2"))
    # Then all three messages arrived intact: neither used the other's socket
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert sorted(queued_keys(queues)) == ["k-child", "k-parent-1", "k-parent-2"]
