"""Routing (issue 11 item 5): each call goes to a worker that serves its tool, waits for one
when none does yet, and ends "did not run" only once its queue deadline has passed.

Workers with different ``--tools`` (or ``--serve``) are real ``dex-tasks worker`` processes;
which tools live workers serve is what they announce in Redis.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from dex_tasks import TOOL_DID_NOT_RUN, CallStatus, DexClient, DexSettings
from dex_tasks.broker.celery_app import RECONCILE_QUEUE, SWEEP
from dex_tasks.broker.routing import (
    TOOL_QUEUE_PREFIX,
    ServeSelectionError,
    announcements_complete,
    live_tools,
    queue_for,
    select_tools,
)
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import expire_unserved, republish_stranded
from tests.conftest import StartWorker, fast_settings
from tests.helpers import ROOT, RedisServer, dex_command, free_port, wait_until
from workers import example_tools, ledger

# The agent process knows the example tools locally; tests.runtime_tools come from the catalog.
assert example_tools.charge_card.name == "charge_card"

HEARTBEAT = 0.3


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    # Quick heartbeats, so a worker that is gone stops counting within 1.5 s.
    return fast_settings(redis_url, sqlite_url, worker_heartbeat_seconds=HEARTBEAT,
                         queue_deadline_seconds=30.0)


def test_calls_of_two_tool_sets_each_reach_a_worker_that_has_the_tool(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given two workers with different tool modules (a rolling deploy, or two pools)
    orders = start_worker(concurrency=1, tools="workers.example_tools")
    pricing = start_worker(concurrency=1, tools="tests.runtime_tools")

    # When an agent calls tools of both, interleaved
    keys = []
    for i in range(10):
        if i % 2:
            record = client.call_tool(session_id="s", turn_id="t", tool_call_id=f"c{i}",
                                      tool="price_sku", arguments={"sku": "abc", "qty": i})
        else:
            record = client.call_tool(session_id="s", turn_id="t", tool_call_id=f"c{i}",
                                      tool="lookup_order", arguments={"order_id": "1001"})
        keys.append(record.key)

    # Then every call succeeds on its first attempt, run by the worker that has its tool
    for key in keys:
        final = client.wait(key, 30)
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
    runs = {e["key"]: e["pid"] for e in ledger.read(ledger_path)}
    for i, key in enumerate(keys):
        worker = pricing if i % 2 else orders
        assert runs[key] in worker.children(), f"{key} ran outside its tool's worker"
    assert ledger.executions(ledger_path) == dict.fromkeys(keys, 1)


def test_a_call_waits_for_a_worker_with_its_tool_and_ends_only_at_its_queue_deadline(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, rt: Runtime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker that serves only lookup_order (it imports charge_card too)
    reads = start_worker(concurrency=1, tools="workers.example_tools", extra_env={},
                         serve="lookup_order")
    wait_until(lambda: "lookup_order" in live_tools(rt.redis), 10, "the worker's heartbeat")
    wait_until(lambda: announcements_complete(rt.redis, HEARTBEAT), 10, "Redis to be up 2 s")
    assert "charge_card" not in live_tools(rt.redis)

    # When an agent calls charge_card (no worker serves it), once with expires_in
    t0 = time.time()
    waiting = client.call_tool(session_id="s", turn_id="t", tool_call_id="waits",
                               tool="charge_card",
                               arguments={"customer_id": "cu_1", "amount_cents": 100})
    expiring = client.call_tool(session_id="s", turn_id="t", tool_call_id="expires",
                                tool="charge_card",
                                arguments={"customer_id": "cu_2", "amount_cents": 200},
                                expires_in=5)
    # ... and a read whose message was lost (its tool is served: only the republisher acts)
    with monkeypatch.context() as patch:
        patch.setattr("dex_tasks.agent.client.publish", lambda *_, **__: None)
        unsent = client.call_tool(session_id="s", turn_id="t", tool_call_id="unsent",
                                  tool="lookup_order", arguments={"order_id": "1002"})

    # Then both charges wait in their tool's queue, not failed by the worker that lacks it
    assert rt.redis.llen(queue_for("charge_card")) == 2
    assert client.get_tool_call(waiting.key).status is CallStatus.QUEUED

    # When the sweeps run after the republish window, before the queue deadline (30 s)
    later = t0 + rt.settings.republish_after_seconds + 1
    assert expire_unserved(rt, now=later) == 0
    # Then nothing is ended, and only the served read is republished (a charge copy would
    # only wait beside the first)
    assert republish_stranded(rt, now=later) == 1
    assert client.wait(unsent.key, 20).status is CallStatus.SUCCEEDED
    assert rt.redis.llen(queue_for("charge_card")) == 2

    # When the expiring call's deadline has passed
    assert expire_unserved(rt, now=t0 + 6) == 1
    # Then it ends "did not run" with the reason; the other charge still waits
    expired = client.get_tool_call(expiring.key)
    assert expired.status is CallStatus.FAILED and expired.attempts == 0
    assert (expired.error or "").startswith(TOOL_DID_NOT_RUN + ": it expired in the queue")
    assert "no live worker serves the tool 'charge_card'" in (expired.error or "")
    assert client.get_tool_call(waiting.key).status is CallStatus.QUEUED

    # When a worker that serves charge_card starts
    start_worker(concurrency=1, tools="workers.example_tools", serve="charge_*")
    # Then the waiting charge runs there, once; the expired one never runs
    assert client.wait(waiting.key, 30).status is CallStatus.SUCCEEDED
    assert expire_unserved(rt, now=t0 + 1000) == 0
    assert ledger.executions(ledger_path) == {unsent.key: 1, waiting.key: 1}
    assert client.get_tool_call(expiring.key).status is CallStatus.FAILED

    # When the only worker serving lookup_order is gone for longer than its announcement
    reads.kill_all()
    wait_until(lambda: "lookup_order" not in live_tools(rt.redis), 10,
               "the dead worker's announcement to expire")
    orphan = client.call_tool(session_id="s", turn_id="t", tool_call_id="orphan",
                              tool="lookup_order", arguments={"order_id": "1001"})
    # Then its calls wait out the queue deadline (30 s) and then end "did not run"
    assert expire_unserved(rt, now=time.time() + 29) == 0
    assert expire_unserved(rt, now=time.time() + 31) == 1
    ended = client.get_tool_call(orphan.key)
    assert ended.status is CallStatus.FAILED
    assert (ended.error or "").startswith(
        TOOL_DID_NOT_RUN + ": no live worker serves the tool 'lookup_order', and the call "
        "waited past its queue deadline of 30s")


def test_nothing_is_ended_until_a_restarted_redis_has_every_announcement_again(
    sqlite_url: str, tmp_path: Path
) -> None:
    # Given a Redis that has just (re)started, so workers' announcements may be missing, and a
    # call that has waited past its queue deadline for a tool nobody announces
    server = RedisServer(free_port()).start()
    started = time.monotonic()
    try:
        settings = fast_settings(f"{server.url}/0", sqlite_url, worker_heartbeat_seconds=1.0,
                                 queue_deadline_seconds=30.0)
        with DexClient(settings) as agent:
            rt = Runtime(settings=settings, store=agent.store,
                         redis=redis.Redis.from_url(settings.redis_url), app=agent.app)
            record = agent.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                     tool="charge_card",
                                     arguments={"customer_id": "cu", "amount_cents": 1})
            # When the sweep runs before Redis has been up for one announcement's lifetime (5 s)
            ended_early = expire_unserved(rt, now=time.time() + 60)
            assert time.monotonic() - started < 5, "too slow to see the first 5 s"
            # Then it ends nothing: it cannot tell a missing worker from a missing announcement
            assert ended_early == 0
            assert agent.get_tool_call(record.key).status is CallStatus.QUEUED
            # When Redis has been up long enough, it ends the call
            wait_until(lambda: announcements_complete(rt.redis, 1.0), 10, "5 s of uptime")
            assert expire_unserved(rt, now=time.time() + 60) == 1
            assert agent.get_tool_call(record.key).status is CallStatus.FAILED
            rt.redis.close()
    finally:
        server.cleanup()


def test_queue_names_are_per_tool_safe_and_stable() -> None:
    assert queue_for("lookup_order") == TOOL_QUEUE_PREFIX + "lookup_order"
    odd = ["a,b", "a b", "a\x06\x16b", "ünï", "x" * 200]
    names = [queue_for(n) for n in odd]
    # Odd names get a plain, bounded queue name, distinct per tool and the same every time.
    assert len(set(names)) == len(odd)
    assert all(n.startswith(TOOL_QUEUE_PREFIX) and n.isascii() and "," not in n
               and " " not in n and len(n) < 100 for n in names)
    assert names == [queue_for(n) for n in odd]
    assert queue_for("a_b") != queue_for("a b")


def test_serve_selects_tools_by_name_or_pattern_and_names_a_bad_one() -> None:
    tools = ["charge_card", "lookup_order", "http_get", "http_post"]
    assert select_tools(tools, None) == sorted(tools)
    assert select_tools(tools, "http_*, lookup_order") == ["http_get", "http_post",
                                                           "lookup_order"]
    with pytest.raises(ServeSelectionError, match=r"'lookup_ordr'.*charge_card"):
        select_tools(tools, "lookup_ordr")


def test_worker_refuses_a_serve_pattern_that_matches_no_tool(env: dict[str, str]) -> None:
    proc = subprocess.run([*dex_command(), "worker", "--tools", "workers.example_tools",
                           "--serve", "no_such_tool"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "'no_such_tool' matches none of the imported tools" in _unboxed(proc.stderr)
    proc = subprocess.run([*dex_command(), "worker", "--tools", "workers.example_tools",
                           "--pool", "gevent"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "prefork, threads" in _unboxed(proc.stderr)


def _unboxed(text: str) -> str:
    """An error message from typer's box, on one line."""
    return " ".join(text.replace("│", " ").split())


def test_a_reconcile_job_is_delivered_to_the_reconcile_queue_only(
    client: DexClient, start_worker: StartWorker, rt: Runtime
) -> None:
    # Given a worker that has declared its tool queues and the reconcile queue, then stopped
    worker = start_worker(concurrency=1, tools="workers.example_tools")
    worker.kill_all()
    # When beat sends the workers' sweep job (reconcile_unknown) to its queue
    client.app.send_task(SWEEP, args=["reconcile_unknown"], queue=RECONCILE_QUEUE)
    # Then that one message is in the reconcile queue, and no tool queue got a copy (a tool
    # queue bound to the default exchange with the default key used to receive one each)
    assert rt.redis.llen(RECONCILE_QUEUE) == 1
    tool_queues = [k.decode() for k in rt.redis.keys(f"{TOOL_QUEUE_PREFIX}*")]
    assert tool_queues == [] or all(rt.redis.llen(q) == 0 for q in tool_queues)
    bound = rt.redis.smembers(f"_kombu.binding.{RECONCILE_QUEUE}")
    assert {b.decode().rsplit("\x06\x16", 1)[-1] for b in bound} == {RECONCILE_QUEUE}


def test_a_workers_brpop_is_the_command_redis_py_would_send_in_kombus_order(
    redis_url: str,
) -> None:
    # Given an app's consumer channel over many tool queues (one list per queue)
    from dex_tasks.broker.celery_app import create_app
    from dex_tasks.settings import DexSettings

    app = create_app(DexSettings(redis_url=redis_url, database_url="sqlite://"))
    queues = [queue_for(f"tool_{i}") for i in range(300)] + [queue_for("ünïcødé tool")]
    try:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            assert channel.priority_steps == [0]
            channel._active_queues[:] = queues
            channel._update_queue_cycle()
            channel.client.connection = channel.client.connection_pool.get_connection()
            sent: list[list[bytes]] = []
            channel.client.connection.send_packed_command = sent.append
            # When it starts a BRPOP, after kombu rotated a queue to the end
            channel._queue_cycle.rotate(queues[5])
            channel._brpop_start()
            # Then the bytes are redis-py's packing of kombu's own key list and timeout
            order = channel._queue_cycle.consume(len(queues))
            assert order[-1] == queues[5]
            expected = b"".join(channel.client.connection.pack_command(
                "BRPOP", *order, channel.brpop_timeout))
            assert len(sent) == 1 and b"".join(sent[0]) == expected
            assert channel._in_poll is channel.client.connection
            channel.client.connection_pool.release(channel.client.connection)
            channel.client.connection = None
            channel._in_poll = None
    finally:
        app.close()
