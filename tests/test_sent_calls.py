"""A client that waits for the calls it sent itself reads nothing: their ends reach it on their
session's channel, which it listened on before it recorded them (``notify.CallWatcher.sent``).

Whenever that cannot be sure (the session was not listened on yet, the connection was lost,
the session was dropped, a message is not a signed record of the call) the waiter reads the
store as before. Waits run with ``wait_poll_seconds=60``: one that returns within seconds was
woken by a notification, never by a poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from dex_tasks import AsyncDexClient, CallStatus, DexClient, DexSettings
from dex_tasks.broker import notify
from dex_tasks.broker.ended import (
    ended_channel,
    parse_session_message,
    session_channel,
    session_message,
)
from dex_tasks.store import Store
from tests.conftest import StartWorker, fast_settings
from tests.helpers import count_reads, wait_in_thread, wait_until

NO_POLL = 60.0
WOKEN_WITHIN = 15.0


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    return fast_settings(redis_url, sqlite_url, wait_poll_seconds=NO_POLL)


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _lookup(client: DexClient, call_id: str, session: str = "s1", sleep: float = 0.0) -> str:
    return client.call_tool(session_id=session, turn_id="t1", tool_call_id=call_id,
                            tool="lookup_order",
                            arguments={"order_id": "1001", "sleep": sleep}).key


def _listening(client: DexClient, session: str = "s1") -> None:
    """Make ``client`` listen on ``session``'s channel: a first wait starts its watcher, and
    the session's subscription is confirmed."""
    client.wait(_lookup(client, "first", session), timeout=NO_POLL / 2)
    wait_until(lambda: client.watcher.sending(session) is not None, 10,
               f"the subscription of {session}")


@pytest.fixture
def reads(client: DexClient, start_worker: StartWorker,
          monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A worker running, ``client`` listening on session ``s1``, and the keys of the calls
    its waits read from the store from now on."""
    start_worker(concurrency=2)
    _listening(client)
    return count_reads(client, monkeypatch)


def test_a_sent_call_is_waited_for_without_reading_the_store(
    client: DexClient, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_worker(concurrency=2)
    # A client that has never waited listens on nothing
    assert client._watcher is None
    _lookup(client, "never-waited")
    assert client._watcher is None
    # Given a client that waited once, and so listens on the session of its calls
    _listening(client)
    reads = count_reads(client, monkeypatch)
    # When it sends a call that ends a second later, and waits for it
    key = _lookup(client, "c1", sleep=1.0)
    started = time.monotonic()
    final = client.wait(key, timeout=NO_POLL / 2)
    took = time.monotonic() - started
    # Then it has the call's ended record, handed by the announcement, with no read at all
    assert final.status is CallStatus.SUCCEEDED and final.result["order_id"] == "1001"
    assert 0.5 < took < WOKEN_WITHIN, f"wait took {took:.2f}s"
    assert reads == []
    # (the record the store holds)
    assert final == client.get_tool_call(key)


def test_an_end_announced_before_the_wait_is_kept_for_it(client: DexClient,
                                                        reads: list[str]) -> None:
    # Given calls that ended before anyone waited for them
    keys = [_lookup(client, f"c{i}") for i in range(5)]
    stored = client.store  # (read apart from the waits' reads)
    wait_until(lambda: all(getattr(stored.get_call(k), "status", None) == "succeeded"
                           for k in keys), WOKEN_WITHIN, "the calls to end")
    # Then each wait returns its own ended record, and reads nothing
    finals = [client.wait(k, timeout=1.0) for k in keys]
    assert [f.key for f in finals] == keys
    assert all(f.status is CallStatus.SUCCEEDED for f in finals)
    assert reads == []
    # And a wait that is over keeps nothing: another wait for the same call reads the store
    assert client.wait(keys[0], timeout=1.0).status is CallStatus.SUCCEEDED
    assert reads == [keys[0]]


def test_the_first_call_of_a_session_is_read_as_before(
    client: DexClient, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_worker(concurrency=2)
    _listening(client, "s1")
    reads = count_reads(client, monkeypatch)
    # A session this client has not listened on yet: its first call cannot count on it
    key = _lookup(client, "c1", session="s2", sleep=0.5)
    assert client.wait(key, timeout=NO_POLL / 2).status is CallStatus.SUCCEEDED
    assert reads and set(reads) == {key}
    # and the session's next call can
    wait_until(lambda: client.watcher.sending("s2") is not None, 10, "the subscription of s2")
    reads.clear()
    key = _lookup(client, "c2", session="s2", sleep=0.5)
    assert client.wait(key, timeout=NO_POLL / 2).status is CallStatus.SUCCEEDED
    assert reads == []


def test_a_lost_connection_sends_the_waiter_back_to_the_store(
    client: DexClient, reads: list[str], admin: redis.Redis
) -> None:
    # Given a call sent under the session's subscription
    key = _lookup(client, "c1", sleep=2.0)
    # When the watcher's connection is cut before the call ends (its end may go unheard)
    # (the watcher's is the one connection that subscribes to channels; Celery's pattern)
    watchers = [c["id"] for c in admin.client_list(_type="pubsub")
                if int(c["sub"]) > 0 and int(c["psub"]) == 0]
    assert len(watchers) == 1
    assert admin.client_kill_filter(_id=watchers[0]) == 1
    # Then the waiter reads the store instead, and still has the call soon after it ends
    started = time.monotonic()
    final = client.wait(key, timeout=NO_POLL / 2)
    assert final.status is CallStatus.SUCCEEDED
    assert time.monotonic() - started < WOKEN_WITHIN
    assert key in reads


def test_a_dropped_session_or_call_sends_the_waiter_back_to_the_store(
    client: DexClient, reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a watcher that keeps one session and two sent calls
    monkeypatch.setattr(notify, "MAX_SESSIONS", 1)
    monkeypatch.setattr(notify, "MAX_SENT", 2)
    waiting = _lookup(client, "waiting", sleep=1.5)
    # When the session is dropped for another while its call runs
    assert client.watcher.sending("s2") is None
    # Then its waiter reads the store, and has the call
    assert client.wait(waiting, timeout=NO_POLL / 2).status is CallStatus.SUCCEEDED
    assert waiting in reads
    # And of three calls sent, the oldest is no longer kept: its waiter reads the store
    _listening(client)
    reads.clear()
    keys = [_lookup(client, f"c{i}", sleep=0.3) for i in range(3)]
    assert all(client.wait(k, timeout=NO_POLL / 2).status is CallStatus.SUCCEEDED
               for k in keys)
    assert set(reads) == {keys[0]}
    # And an end longer than the characters a watcher keeps is not kept
    monkeypatch.setattr(notify, "MAX_KEPT_CHARS", 100)
    reads.clear()
    key = _lookup(client, "long")
    wait_until(lambda: key not in client.watcher._sent, WOKEN_WITHIN, "the end to be dropped")
    assert client.wait(key, timeout=NO_POLL / 2).status is CallStatus.SUCCEEDED
    assert reads == [key]


def test_a_waiter_whose_call_is_dropped_while_it_waits_reads_the_store_at_once(
    client: DexClient, reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a watcher that keeps one sent call, and a waiter of that call while it runs
    monkeypatch.setattr(notify, "MAX_SENT", 1)
    waiting = _lookup(client, "waiting", sleep=2.0)
    thread, out = wait_in_thread(client, waiting, NO_POLL / 2)
    wait_until(lambda: client.watcher._sent[waiting].watches, WOKEN_WITHIN, "the waiter")
    # When another call is sent, and the first is dropped from what the watcher keeps
    _lookup(client, "next")
    assert waiting not in client.watcher._sent
    # Then its waiter is woken to read the store (its end would go unheard: no poll for a
    # minute), and has the call soon after it ends
    thread.join(WOKEN_WITHIN)
    assert "error" not in out, out
    assert out["record"].status is CallStatus.SUCCEEDED
    assert out["took"] < WOKEN_WITHIN
    assert waiting in reads


def test_a_waiter_is_covered_only_while_its_call_is_kept_for_it(
    client: DexClient, reads: list[str]
) -> None:
    # Given a sent call's waiter, covered while the call is kept under its confirmation
    watcher = client.watcher
    confirmed = watcher.sending("s1")
    assert confirmed is not None
    watcher.sent("s1/t9/c9", "s1", confirmed)
    watch = watcher.watch_sent("s1/t9/c9")
    assert watch is not None and watch.covered
    # When the same key is recorded as sent again, the entry its waiter was held on is gone
    watcher.sent("s1/t9/c9", "s1", confirmed)
    # Then that waiter is no longer covered (it reads the store), and a new one is
    assert not watch.covered
    again = watcher.watch_sent("s1/t9/c9")
    assert again is not None and again.covered
    again.close()
    watch.close()


def test_an_end_announced_only_on_its_calls_channel_costs_one_poll_interval(
    redis_url: str, sqlite_url: str, start_worker: StartWorker, admin: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a client that polls every half second as its safety net, listening on s1
    start_worker(concurrency=2)
    with DexClient(fast_settings(redis_url, sqlite_url, wait_poll_seconds=0.5)) as client:
        _listening(client)
        reads = count_reads(client, monkeypatch)
        # and a sent call that runs for a long time, and its waiter
        key = _lookup(client, "c1", sleep=30.0)
        thread, out = wait_in_thread(client, key, NO_POLL / 2)
        # When it ends as a worker of a release before session channels announces it: on the
        # call's own channel only (here a bare status, after a write with no hooks)
        silent = Store(sqlite_url)
        try:
            assert silent.transition(key, CallStatus.RUNNING)
            assert silent.transition(key, CallStatus.SUCCEEDED, values={"result": "1"})
        finally:
            silent.close()
        admin.publish(ended_channel(key), "succeeded")
        thread.join(WOKEN_WITHIN)
    # Then the waiter reads the store after one poll interval, and has the call
    assert out["record"].status is CallStatus.SUCCEEDED
    assert out["took"] < WOKEN_WITHIN
    assert key in reads


@pytest.mark.parametrize("forged", ["succeeded", "succeeded forged.record.signature"])
def test_a_message_that_is_not_a_signed_record_of_the_call_is_not_believed(
    client: DexClient, reads: list[str], admin: redis.Redis, forged: str
) -> None:
    # Given a sent call that runs for two seconds
    key = _lookup(client, "c1", sleep=2.0)
    # When someone who can publish on Redis announces its end first
    assert admin.publish(session_channel("s1"), session_message(key, forged)) == 1
    # Then its waiter reads the store, and waits for the real end
    final = client.wait(key, timeout=NO_POLL / 2)
    assert final.status is CallStatus.SUCCEEDED and final.result["order_id"] == "1001"
    assert key in reads


def test_an_async_client_waits_for_its_sent_calls_without_reading(
    settings: DexSettings, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_worker(concurrency=2)

    async def agent() -> tuple[list[CallStatus], list[str]]:
        async with AsyncDexClient(settings) as client:
            first = await client.call_tool(session_id="s1", turn_id="t0", tool_call_id="c0",
                                           tool="lookup_order", arguments={"order_id": "1"})
            await client.wait(first.key, timeout=NO_POLL / 2)
            wait_until(lambda: client.sync.watcher.sending("s1") is not None, 10,
                       "the subscription of s1")
            reads = count_reads(client.sync, monkeypatch)
            records = await client.call_tools(
                [{"tool_call_id": f"c{i}", "tool": "lookup_order",
                  "arguments": {"order_id": "1001", "sleep": 0.5}} for i in range(4)],
                session_id="s1", turn_id="t1")
            finals = await asyncio.gather(*(client.wait(r.key, timeout=NO_POLL / 2)
                                            for r in records))
            return [f.status for f in finals], reads

    statuses, reads = asyncio.run(agent())
    assert statuses == [CallStatus.SUCCEEDED] * 4
    assert reads == []


def test_a_session_message_names_its_call_whatever_the_ids_hold() -> None:
    key = "a:b 3/turn: 7/é:"
    assert parse_session_message(session_message(key, "failed x.y")) == (key, "failed x.y")
    assert parse_session_message(session_message(key, "").encode()) == (key, "")
    for junk in ("", "succeeded", "x:abc", "99:short", b"\xff:"):
        assert parse_session_message(junk) is None

