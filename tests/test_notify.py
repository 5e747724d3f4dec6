"""Waiters wake when their call ends: a Redis notification after the commit, whoever ends it,
with the store polled only as the fallback for a lost notification.

Waits here run with ``wait_poll_seconds=60``: a wait that returns within seconds was woken by
a notification (or by the confirmation of its subscription), never by a poll.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from dex_tasks import AsyncDexClient, CallStatus, DexClient, DexSettings, registry
from dex_tasks.broker.announce import ANNOUNCE_SHA, SCRIPT_MAX_CALLS, EndedNotifier, install
from dex_tasks.broker.ended import (
    CHANNEL_PREFIX,
    SESSION_CHANNEL_PREFIX,
    ended_channel,
    message_status,
    redis_connector,
)
from dex_tasks.broker.metrics import ENDED_KEY
from dex_tasks.broker.notify import CallWatcher
from dex_tasks.broker.runs import RUNS_KEY, Runs
from dex_tasks.store import EndedCall, Store
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import (
    ROOT,
    count_reads,
    dex_command,
    free_port,
    started_pid,
    wait_in_thread,
    wait_until,
)

NO_POLL = 60.0  # wait_poll_seconds in these tests: far beyond any bound asserted below
WOKEN_WITHIN = 15.0  # a generous bound for a loaded 2-core machine, far below NO_POLL


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    return fast_settings(redis_url, sqlite_url, wait_poll_seconds=NO_POLL)


class Announcements:
    """Every ``dex:ended:*`` message published on a Redis database, collected by a thread."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.psubscribe(CHANNEL_PREFIX + "*")
        wait_until(lambda: self.pubsub.get_message(timeout=0.1), 5, "the psubscribe reply")
        self.seen: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.1)
            if message and message["type"] == "pmessage":
                channel = message["channel"].decode()
                if channel.startswith(SESSION_CHANNEL_PREFIX):
                    continue  # the same ends, for the clients that sent them
                # (the status, then the ended record a waiter is handed: message_status)
                self.seen.append((channel.removeprefix(CHANNEL_PREFIX),
                                  message_status(message["data"])))

    def wait_for(self, key: str, status: CallStatus, timeout: float = 20.0) -> None:
        wait_until(lambda: (key, status.value) in self.seen, timeout,
                   f"the end of {key} ({status.value}) to be announced")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()
        self.client.close()


@pytest.fixture
def announced(redis_url: str) -> Iterator[Announcements]:
    listener = Announcements(redis_url)
    yield listener
    listener.close()


def test_wait_is_woken_when_the_worker_ends_the_call(
    client: DexClient, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_worker(concurrency=2)
    reads = count_reads(client, monkeypatch)
    # Given a read that takes three seconds, and a waiter subscribed before it ends
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001", "sleep": 3.0})
    started = time.monotonic()
    final = client.wait(record.key, timeout=NO_POLL / 2)
    took = time.monotonic() - started
    # Then the waiter has the record soon after the call ended, long before any poll
    assert final.status is CallStatus.SUCCEEDED and final.result["order_id"] == "1001"
    assert 2.5 < took < WOKEN_WITHIN, f"wait took {took:.2f}s"
    assert client.watcher.live
    # And it read the store only when told to: first, once subscribed, once the call ended
    # (polling every 5-200 ms would have read it fifteen times or more)
    assert len(reads) <= 4, f"{len(reads)} reads of the store while waiting"


def test_async_waits_are_woken_together(settings: DexSettings, start_worker: StartWorker,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    start_worker(concurrency=2)

    async def agent() -> tuple[list[CallStatus], float, int]:
        async with AsyncDexClient(settings) as client:
            reads = count_reads(client.sync, monkeypatch)
            records = await client.call_tools(
                [{"tool_call_id": f"c{i}", "tool": "lookup_order",
                  "arguments": {"order_id": "1001", "sleep": 1.0}} for i in range(6)],
                session_id="s1", turn_id="t1")
            started = time.monotonic()
            finals = await asyncio.gather(*(client.wait(r.key, timeout=NO_POLL / 2)
                                            for r in records))
            return [f.status for f in finals], time.monotonic() - started, len(reads)

    statuses, took, reads = asyncio.run(agent())
    assert statuses == [CallStatus.SUCCEEDED] * 6
    # Six one-second calls on two children take about 3 s; a poll would take 60.
    assert 2.5 < took < WOKEN_WITHIN, f"the waits took {took:.2f}s"
    # Each wait read its call a few times (polling would have read each one 15+ times)
    assert reads <= 6 * 4, f"{reads} reads of the store for 6 waits"


def test_a_call_that_ends_before_the_subscription_is_still_seen(
    client: DexClient, settings: DexSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a call that ends, with no notification at all (a store with no hooks), right
    # after the waiter's first read and before its subscription is confirmed
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1001"})
    silent = Store(settings.database_url)
    first_read = client._stored_call  # the waiter's read of the store

    def read_then_end(key: str) -> Any:
        found = first_read(key)
        if not found.terminal:
            assert silent.transition(key, CallStatus.RUNNING)
            assert silent.transition(key, CallStatus.SUCCEEDED, values={"result": "1"})
        return found

    monkeypatch.setattr(client, "_stored_call", read_then_end)
    try:
        started = time.monotonic()
        final = client.wait(record.key, timeout=NO_POLL / 2)
        took = time.monotonic() - started
    finally:
        silent.close()
    # Then the confirmed subscription made it read the store again, with no poll
    assert final.status is CallStatus.SUCCEEDED
    assert took < WOKEN_WITHIN, f"wait took {took:.2f}s"


def test_every_path_that_ends_a_call_announces_it(
    client: DexClient, settings: DexSettings, start_worker: StartWorker, ledger_path: Path,
    announced: Announcements, monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = start_worker(concurrency=2)

    def call(call_id: str, tool: str, **kw: Any) -> str:
        return client.call_tool(session_id="s1", turn_id="t1", tool_call_id=call_id,
                                tool=tool, **kw).key

    # The worker's child ends calls: a result, and a tool error
    ok = call("ok", "lookup_order", arguments={"order_id": "1001"})
    announced.wait_for(ok, CallStatus.SUCCEEDED)
    broken = call("broken", "broken_report", arguments={"report": "nope"})
    announced.wait_for(broken, CallStatus.FAILED)
    # The worker's main process ends a call whose child was killed
    charge = call("charge", "charge_card",
                  arguments={"customer_id": "cu_1", "amount_cents": 5, "sleep": 30})
    os.kill(started_pid(ledger_path, charge), signal.SIGKILL)
    announced.wait_for(charge, CallStatus.OUTCOME_UNKNOWN)
    # The worker ends a call whose arguments its schema refuses: "did not run" (this process
    # forgets the tool's code, so the worker is the one to check them)
    monkeypatch.delitem(registry._REGISTRY, "lookup_order")
    bad = call("bad", "lookup_order", arguments={"order_id": 5})
    announced.wait_for(bad, CallStatus.FAILED)
    worker.kill_all()

    # The client ends calls: a person's rejection, arguments a local tool refuses
    refund = client.call_tool(session_id="s1", turn_id="t2", tool_call_id="refund",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 5})
    assert refund.interrupt_id is not None
    assert client.resolve_interrupt("s1", refund.interrupt_id, False, "no")
    announced.wait_for(refund.key, CallStatus.REJECTED)

    # The sweeps, in another process (`dex-tasks sweep`): an approval past its deadline, a
    # running call whose worker is gone, a queued call that expired while its message was lost
    late = client.call_tool(session_id="s1", turn_id="t3", tool_call_id="late",
                            tool="refund_payment",
                            arguments={"charge_id": "ch_2", "amount_cents": 5},
                            approval_deadline=0.01).key
    lost = call("lost", "charge_card", arguments={"customer_id": "cu_2", "amount_cents": 5})
    assert client.store.transition(lost, CallStatus.RUNNING, values={
        "worker": "gone@host:1", "attempts": 1, "lease_expires_at": time.time() - 60})
    stale = call("stale", "lookup_order", arguments={"order_id": "1001"}, expires_in=0.01)
    client.store.mark_published(stale, time.time() - 3600)
    done = subprocess.run([*dex_command(), "sweep"], cwd=ROOT, env=settings_env(settings),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    announced.wait_for(late, CallStatus.REJECTED)
    announced.wait_for(lost, CallStatus.OUTCOME_UNKNOWN)
    announced.wait_for(stale, CallStatus.FAILED)

    # And nothing was announced that did not end
    ended = {k for k, _ in announced.seen}
    for key, _status in announced.seen:
        assert client.get_tool_call(key).terminal
    assert ended == {ok, broken, charge, bad, refund.key, late, lost, stale}


def test_a_lost_notification_costs_one_poll_interval(redis_url: str, sqlite_url: str) -> None:
    # Given a waiter that polls every half second as its safety net
    with DexClient(fast_settings(redis_url, sqlite_url, wait_poll_seconds=0.5)) as client:
        record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        thread, out = wait_in_thread(client, record.key, NO_POLL / 2)
        wait_until(lambda: client.watcher.live, 10, "the watcher to connect")
        # When the call ends with no notification (a store with no hooks: the message lost)
        silent = Store(sqlite_url)
        try:
            assert silent.transition(record.key, CallStatus.RUNNING)
            assert silent.transition(record.key, CallStatus.SUCCEEDED, values={"result": "1"})
        finally:
            silent.close()
        thread.join(NO_POLL)
    # Then the waiter still has it, from its poll
    assert "error" not in out, out
    assert out["record"].status is CallStatus.SUCCEEDED
    assert out["took"] < WOKEN_WITHIN


def test_wait_polls_quickly_while_redis_is_unreachable(sqlite_url: str,
                                                       redis_url: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    # Given a waiter whose Redis is down (and a writer whose Redis is up)
    with DexClient(fast_settings(dead, sqlite_url, wait_poll_seconds=NO_POLL)) as waiter, \
            DexClient(fast_settings(redis_url, sqlite_url)) as writer:
        record = writer.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        thread, out = wait_in_thread(waiter, record.key, NO_POLL / 2)
        wait_until(lambda: waiter._watcher is not None and not waiter.watcher.live, 10,
                   "the waiter's watcher to find Redis down")
        # When the call ends
        assert writer.store.transition(record.key, CallStatus.RUNNING)
        assert writer.store.transition(record.key, CallStatus.SUCCEEDED, values={"result": "1"})
        thread.join(NO_POLL)
    # Then the waiter sees it from the store within its fast polling
    assert "error" not in out, out
    assert out["record"].status is CallStatus.SUCCEEDED
    assert out["took"] < WOKEN_WITHIN


def test_an_unreachable_redis_never_fails_or_stalls_a_transition(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.create_all()
    install(store, f"redis://127.0.0.1:{free_port()}/0")
    try:
        with DexClient(fast_settings(f"redis://127.0.0.1:{free_port()}/0", sqlite_url)) as c:
            keys = [c.call_tool(session_id="s1", turn_id="t1", tool_call_id=f"c{i}",
                                tool="charge_card",
                                arguments={"customer_id": "cu", "amount_cents": 1}).key
                    for i in range(20)]
        # (the publish failed, so each call already ended "did not run"; start afresh)
        rows = [{"key": f"s2/t/c{i}", "session_id": "s2", "turn_id": "t",
                 "tool_call_id": f"c{i}", "tool": "lookup_order", "arguments": "{}",
                 "effect": "read", "requires_approval": False, "max_attempts": 3,
                 "status": "queued", "attempts": 0, "created_at": time.time(),
                 "updated_at": time.time()} for i in range(20)]
        assert store.insert_calls(rows)
        started = time.monotonic()
        for row in rows:
            assert store.transition(row["key"], CallStatus.FAILED, values={"error": "x"})
        took = time.monotonic() - started
        assert all(store.get_call(k).status == CallStatus.FAILED.value for k in keys)
    finally:
        store.close()
    # One failed attempt to reach Redis (about a second), then quiet: never one per call.
    assert took < 10, f"20 transitions took {took:.2f}s with Redis down"


def test_watcher_recovers_after_redis_restarts(tmp_path: Path) -> None:
    from tests.helpers import RedisServer

    server = RedisServer(free_port()).start()
    url = f"{server.url}/0"
    sqlite = f"sqlite:///{tmp_path / 'dex.db'}"
    try:
        with DexClient(fast_settings(url, sqlite, wait_poll_seconds=NO_POLL)) as client:
            runtime = Runtime(settings=client.settings, store=client.store,
                              redis=redis.Redis.from_url(url), app=client.app)
            # Given a waiter connected to Redis, and a Redis restart
            watcher: CallWatcher = client.watcher
            with watcher.watch("warm/up/call"):
                wait_until(lambda: watcher.live, 10, "the watcher to connect")
            server.stop()
            wait_until(lambda: not watcher.live, 20, "the watcher to see Redis gone")
            server.start()
            wait_until(lambda: watcher.live, 20, "the watcher to reconnect")
            # When a call ends (an approval whose deadline passed, by the sweep)
            record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                      tool="refund_payment",
                                      arguments={"charge_id": "ch", "amount_cents": 5},
                                      approval_deadline=0.5)
            thread, out = wait_in_thread(client, record.key, NO_POLL / 2)
            wait_until(lambda: ended_channel(record.key) in watcher._watches, 10, "the watch")
            wait_until(lambda: run_job(runtime, "expire_approvals") == 1, 20, "the deadline")
            thread.join(NO_POLL)
            runtime.redis.close()
    finally:
        server.cleanup()
    # Then the waiter was woken by the notification, not by a poll
    assert "error" not in out, out
    assert out["record"].status is CallStatus.REJECTED
    assert out["took"] < WOKEN_WITHIN


def _connections(admin: redis.Redis) -> int:
    """Client connections the server holds, not counting ``admin``'s own."""
    return len(admin.client_list()) - 1


def test_a_watcher_holds_one_redis_connection_however_many_calls_it_watches() -> None:
    from tests.helpers import RedisServer

    server = RedisServer(free_port()).start()
    admin = redis.Redis.from_url(f"{server.url}/0")
    watcher = CallWatcher(redis_connector(f"{server.url}/0"))
    try:
        before = _connections(admin)
        # Given a watcher whose thread waits on its connection
        with watcher.watch("first/call") as first:
            assert first.wait(WOKEN_WITHIN), "the first subscription was not confirmed"
            # When more calls are watched and one is announced
            watches = [watcher.watch(f"more/call/{i}") for i in range(5)]
            for watch in watches:
                assert watch.wait(WOKEN_WITHIN), "a subscription was not confirmed"
            assert admin.publish(ended_channel("more/call/3"), "succeeded") == 1
            assert watches[3].wait(WOKEN_WITHIN)
            assert watches[3].message == b"succeeded"
            # Then one connection served them all: the thread was woken for each new watch
            # through a pipe of its own, not by a publish on a second connection
            assert _connections(admin) == before + 1
            for watch in watches:
                watch.close()
        watcher.close()
        wait_until(lambda: _connections(admin) == before, 10, "the watcher's connection to close")
    finally:
        watcher.close()
        admin.close()
        server.cleanup()


def test_a_new_watch_is_subscribed_at_once_however_long_the_thread_would_wait(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dex_tasks.broker import notify

    # Given a watcher thread that would wait a minute for Redis before looking again
    monkeypatch.setattr(notify, "_IDLE_WAIT_SECONDS", 60.0)
    watcher = CallWatcher(redis_connector(redis_url))
    try:
        with watcher.watch("idle/first/call") as first:
            assert first.wait(WOKEN_WITHIN)
            # When a call is watched while the thread waits
            for i in range(3):
                started = time.monotonic()
                with watcher.watch(f"idle/next/call/{i}") as watch:
                    # Then its subscription is sent and confirmed at once: the waiter woke
                    # the thread, which did not sit out its wait
                    assert watch.wait(WOKEN_WITHIN), "the thread was not woken for a watch"
                assert time.monotonic() - started < WOKEN_WITHIN
    finally:
        watcher.close()
    assert watcher._thread is not None and not watcher._thread.is_alive()


def test_a_forked_child_watches_with_its_own_thread_and_pipe(redis_url: str) -> None:
    watcher = CallWatcher(redis_connector(redis_url))
    publisher = redis.Redis.from_url(redis_url)
    try:
        # Given a parent whose watcher runs
        with watcher.watch("fork/parent/before") as before:
            assert before.wait(WOKEN_WITHIN)
        pid = os.fork()
        if pid == 0:  # the child: watch and be woken by an announcement, then report
            code = 1
            try:
                child_publisher = redis.Redis.from_url(redis_url)
                with watcher.watch("fork/child/call") as watch:
                    if watch.wait(WOKEN_WITHIN):
                        child_publisher.publish(ended_channel("fork/child/call"), "failed")
                        if watch.wait(WOKEN_WITHIN) and watch.message == b"failed":
                            code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        # Then the child was woken by its own subscription and announcement
        assert os.waitstatus_to_exitcode(status) == 0
        # And the parent's watcher still works
        with watcher.watch("fork/parent/after") as after:
            assert after.wait(WOKEN_WITHIN)
            publisher.publish(ended_channel("fork/parent/after"), "succeeded")
            assert after.wait(WOKEN_WITHIN)
            assert after.message == b"succeeded"
    finally:
        watcher.close()
        publisher.close()


def _ended_batch(prefix: str, count: int) -> list[EndedCall]:
    """``count`` ended calls over two tools, three statuses and several latency buckets."""
    now = time.time()
    statuses = (CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.OUTCOME_UNKNOWN)
    return [EndedCall(f"{prefix}/t/c{i}", prefix, ("lookup_order", "charge_card")[i % 2],
                      ("read", "non_idempotent_write")[i % 2], statuses[i % 3],
                      now - (0.003, 0.2, 7.0, 4000.0)[i % 4], now)
            for i in range(count)]


def _announce_all(notifier: EndedNotifier, batches: list[list[EndedCall]]) -> dict[bytes, bytes]:
    client = notifier.client
    client.delete(ENDED_KEY)
    for batch in batches:
        notifier(batch)
    return client.hgetall(ENDED_KEY)


def test_the_announcement_script_counts_and_publishes_as_the_pipeline_does(
    redis_url: str, announced: Announcements
) -> None:
    # Given a notifier, and batches that the script announces (up to SCRIPT_MAX_CALLS calls)
    # and one, a sweep's, that goes as a pipeline
    notifier = EndedNotifier(redis_url, redis_connector(redis_url))
    plain = EndedNotifier(redis_url, redis_connector(redis_url), scripted=False)
    batches = [_ended_batch("one", 1), _ended_batch("few", 7),
               _ended_batch("many", SCRIPT_MAX_CALLS + 5)]
    try:
        # When they are announced with the script, then again with plain commands only
        scripted = _announce_all(notifier, batches)
        pipelined = _announce_all(plain, batches)

        # Then the counters are the same (bucket counts and latency totals), and every call
        # was announced on its channel, both times
        assert scripted == pipelined
        assert len(scripted) == 6 * 2 + 6  # 6 label sets, 2 buckets and a total each
        for batch in batches:
            for call in batch:
                wait_until(lambda c=call: announced.seen.count((c.key, c.status.value)) == 2,
                           10, f"{call.key} announced twice")
        assert notifier.scripted and not plain.scripted
    finally:
        notifier.close()
        plain.close()


def test_the_announcement_script_is_loaded_again_after_redis_forgot_it(redis_url: str) -> None:
    # Given a notifier that has loaded its script, and a Redis that then lost it (a restart,
    # a failover to a replica that never ran it)
    notifier = EndedNotifier(redis_url, redis_connector(redis_url))
    try:
        notifier(_ended_batch("before", 1))
        notifier.client.script_flush()

        # When it announces the next call
        notifier(_ended_batch("after", 1))

        # Then that call is counted too, still by the script
        counts = notifier.client.hgetall(ENDED_KEY)
        assert sum(int(v) for f, v in counts.items() if not f.endswith(b'"sum"]')) == 2
        assert notifier.scripted
        assert notifier.client.script_exists(ANNOUNCE_SHA) == [True]
    finally:
        notifier.close()


def test_a_redis_that_refuses_scripts_gets_the_plain_commands(
    redis_url: str, announced: Announcements, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a Redis user whose ACL refuses scripting (as some managed Redis services do)
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("noscript", enabled=True, passwords=["+pw"], keys=["~*"],
                      channels=["*"], commands=["+@all", "-@scripting"])
    url = redis_url.replace("redis://", "redis://noscript:pw@")
    notifier = EndedNotifier(url, redis_connector(url))
    try:
        # When its notifier announces calls
        notifier(_ended_batch("first", 2))
        notifier(_ended_batch("second", 3))

        # Then they are announced and counted all the same, with plain commands from the
        # first refusal on, which is logged once
        counts = admin.hgetall(ENDED_KEY)
        assert sum(int(v) for f, v in counts.items() if not f.endswith(b'"sum"]')) == 5
        for call in _ended_batch("first", 2) + _ended_batch("second", 3):
            announced.wait_for(call.key, call.status, timeout=10)
        refusals = [r for r in caplog.records
                    if getattr(r, "action", None) == "notify_script_refused"]
        assert len(refusals) == 1
        assert not notifier.scripted
    finally:
        notifier.close()
        admin.acl_deluser("noscript")
        admin.close()


def test_an_error_inside_the_script_does_not_stop_scripting(
    redis_url: str, announced: Announcements
) -> None:
    # Given a counters hash that something else overwrote with a string
    notifier = EndedNotifier(redis_url, redis_connector(redis_url))
    try:
        notifier.client.set(ENDED_KEY, "not a hash")

        # When a call is announced: the script publishes, then fails at its first counter,
        # and the pipeline that follows meets the same error
        call = _ended_batch("wrongtype", 1)[0]
        notifier([call])

        # Then the waiters were still woken, nothing was counted, and the notifier keeps the
        # script for its next announcements: only a refusal of scripts turns it off
        announced.wait_for(call.key, call.status, timeout=10)
        assert notifier.client.get(ENDED_KEY) == b"not a hash"
        assert notifier.scripted
    finally:
        notifier.close()


def _commands(client: redis.Redis, name: str) -> int:
    """How many ``name`` commands this Redis has run (``INFO commandstats``)."""
    return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@pytest.mark.parametrize("scripted", [True, False], ids=["script", "pipeline"])
def test_an_ended_retrying_calls_run_ends_with_its_announcement(redis_url: str,
                                                                 scripted: bool) -> None:
    # Given three retrying calls running in Redis (broker/runs.py): one whose ending names the
    # worker that holds its run, one whose run another worker holds (a later attempt), and
    # one whose ending names no worker
    notifier = EndedNotifier(redis_url, redis_connector(redis_url), scripted=scripted)
    runs = Runs(notifier.client)
    now = time.time()
    base = f"fold-{scripted}-{now}"
    keys = {name: f"{base}/{name}" for name in ("own", "other", "none")}
    holders = {"own": "node:1", "other": "node:2", "none": "node:1"}
    for name, key in keys.items():
        assert runs.start(key, holders[name], stored_attempts=0, max_attempts=3,
                          lease_seconds=30, started=now, ttl=600)[0] == 1
    named = {"own": "node:1", "other": "node:1", "none": None}
    ended = [EndedCall(key, base, "lookup_order", "read", CallStatus.SUCCEEDED, now, now,
                       worker=named[name])
             for name, key in keys.items()]
    evalsha = _commands(notifier.client, "evalsha")
    try:
        # When their endings are announced
        notifier(ended)

        # Then, with the script, in that one command, the ended attempt's run is dropped
        # (hash, lease and count), as Runs.release does; the other worker's run is left to it
        # (and to the reaper, should it be lost) and only the counts go. Without scripts the
        # counts go and the runs lapse with their leases.
        assert runs.attempts(keys["own"]) == 0
        assert runs.attempts(keys["other"]) == runs.attempts(keys["none"]) == 0
        assert runs.get(keys["other"]) is not None and runs.get(keys["none"]) is not None
        if scripted:
            assert _commands(notifier.client, "evalsha") == evalsha + 1
            assert runs.get(keys["own"]) is None
            assert notifier.client.zscore(RUNS_KEY, keys["own"]) is None
            assert notifier.client.zscore(RUNS_KEY, keys["other"]) is not None
        else:
            assert runs.get(keys["own"]) is not None
    finally:
        for key in keys.values():
            runs.release(key, "node:1", ended=True)
            runs.release(key, "node:2", ended=True)
        notifier.close()
