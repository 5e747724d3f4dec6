"""Guarantee 2, the "did not run" half: a call that never reached its tool ends ``failed`` with
an error that begins exactly with TOOL_DID_NOT_RUN, and the ledger shows no execution.

Also the errors ``call_tool`` raises instead of recording a call: an unknown tool, and an
idempotency key reused for another tool or other arguments.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    CallStatus,
    ConflictError,
    DexClient,
    ToolCallRecord,
    UnknownToolError,
    registry,
)
from dex_tasks.broker.routing import announcements_complete, queue_for
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_all
from tests.conftest import StartWorker, fast_settings
from tests.helpers import free_port, wait_until
from workers import example_tools, ledger

PREFIX = "the tool did not run, so it is safe to call again"


def _assert_did_not_run(record: ToolCallRecord, *mentions: str) -> None:
    assert record.status is CallStatus.FAILED
    assert record.error is not None
    assert record.error.startswith(PREFIX + ": "), record.error
    assert record.attempts == 0
    for text in mentions:
        assert text in record.error


def test_the_public_prefix_is_exact() -> None:
    assert TOOL_DID_NOT_RUN == PREFIX


def test_broker_unreachable_at_publish_fails_fast(sqlite_url: str, ledger_path: Path) -> None:
    # Given a client whose broker is a closed port
    settings = fast_settings(f"redis://127.0.0.1:{free_port()}/0", sqlite_url)
    with DexClient(settings) as client:
        # When it calls a tool, on each path
        for call_id, tool, arguments in [
            ("c1", "lookup_order", {"order_id": "1001"}),
            ("c2", "charge_card", {"customer_id": "cu_1", "amount_cents": 100}),
        ]:
            started = time.monotonic()
            record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id=call_id,
                                      tool=tool, arguments=arguments)
            # Then it returns within seconds, with a failed "did not run" record
            assert time.monotonic() - started < 5
            _assert_did_not_run(record, "broker could not be reached")
            # and the same key again returns the same record without trying again
            again = client.call_tool(session_id="s1", turn_id="t1", tool_call_id=call_id,
                                     tool=tool, arguments=arguments)
            assert again == record
    assert ledger.read(ledger_path) == []


def test_invalid_arguments_checked_in_the_client_when_the_tool_is_local(
    client: DexClient,
) -> None:
    assert registry.get_local_tool("lookup_order") is example_tools.lookup_order
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="lookup_order", arguments={"order": "1001", "sleep": "long"})
    _assert_did_not_run(record, "'lookup_order'", "order_id", "sleep", "order")
    # Nothing was sent: it never became anything but queued -> failed.
    events = [(e.from_status, e.to_status) for e in client.store.events_for_call(record.key)]
    assert events == [(None, "queued"), ("queued", "failed")]


def test_invalid_arguments_refused_at_call_tool_when_the_client_knows_only_the_catalog(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker that published the catalog, and an agent process without the tool code
    worker = start_worker(concurrency=1)
    monkeypatch.delitem(registry._REGISTRY, "update_address")
    monkeypatch.delitem(registry._REGISTRY, "charge_card")
    # When calls with bad arguments are made on both paths
    write = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                             tool="update_address", arguments={"order_id": "1001"})
    charge = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                              tool="charge_card",
                              arguments={"customer_id": "cu_1", "amount_cents": "lots"})
    # Then the policy came from the catalog, and call_tool refused them from the published
    # schema at once, whatever the path (issue 31 item 4: nothing is queued to fail later)
    assert write.effect.value == "idempotent_write"
    assert charge.effect.value == "non_idempotent_write" and not charge.requires_approval
    _assert_did_not_run(write, "'update_address'", "address")
    _assert_did_not_run(charge, "'charge_card'", "amount_cents")
    # And a valid call still runs, so the worker really was consuming
    good = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c3",
                            tool="update_address",
                            arguments={"order_id": "1001", "address": "1 Main St"})
    assert client.wait(good.key, 20).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path) == {good.key: 1}
    worker.kill_all()


def test_message_expired_before_a_worker_started_it(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given calls on both paths that may wait at most 0.3s, and no worker running
    keys = []
    for call_id, tool, arguments in [
        ("c1", "lookup_order", {"order_id": "1001"}),
        ("c2", "charge_card", {"customer_id": "cu_1", "amount_cents": 100}),
    ]:
        record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id=call_id,
                                  tool=tool, arguments=arguments, expires_in=0.3)
        assert record.status is CallStatus.QUEUED
        keys.append(record.key)
    deadline = time.time() + 0.3
    wait_until(lambda: time.time() > deadline, 5, "the calls to expire")

    # When a worker starts and receives the expired messages
    worker = start_worker(concurrency=1)

    # Then both end "did not run" without the sweep's help, and no tool ran
    for key in keys:
        _assert_did_not_run(client.wait(key, 20), "expired")
    assert ledger.read(ledger_path) == []
    worker.kill_all()


def test_expired_call_whose_message_is_gone_is_ended_by_the_sweep(
    client: DexClient, rt: Runtime, ledger_path: Path
) -> None:
    # Given a queued call that expired and whose message nobody will deliver
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="charge_card",
                              arguments={"customer_id": "cu_1", "amount_cents": 1},
                              expires_in=60)
    rt.redis.flushdb()
    # (a Redis that just started may not have every worker's announcement yet)
    wait_until(lambda: announcements_complete(rt.redis, rt.settings.worker_heartbeat_seconds),
               30, "Redis to have been up for one announcement's lifetime")
    # When the sweeps run after the republish window and after the expiry (no worker serves
    # the tool: the republisher leaves it, the queue-deadline sweep ends it)
    moved = run_all(rt, now=time.time() + 120)
    # Then the call ends "did not run"; it was not republished
    assert moved["republish_stranded"] == 0 and moved["expire_unserved"] == 1
    _assert_did_not_run(client.get_tool_call(record.key), "expired", "no live worker")
    assert rt.redis.llen(queue_for("charge_card")) == 0
    assert ledger.read(ledger_path) == []


def test_unknown_tool_raises_naming_it_and_stores_nothing(client: DexClient) -> None:
    with pytest.raises(UnknownToolError, match="'no_such_tool'") as err:
        client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                         tool="no_such_tool", arguments={})
    assert err.value.tool == "no_such_tool"
    assert client.get_agent_snapshot("s1").tool_calls == []


def test_same_key_with_another_tool_or_arguments_is_a_conflict(client: DexClient) -> None:
    first = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                             tool="lookup_order", arguments={"order_id": "1001"},
                             expires_in=60)
    with pytest.raises(ConflictError, match="tool") as err:
        client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                         tool="update_address", arguments={"order_id": "1001"})
    assert (err.value.key, err.value.field) == ("s1/t1/c1", "tool")
    with pytest.raises(ConflictError, match="arguments"):
        client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                         tool="lookup_order", arguments={"order_id": "1002"})
    # The same request again (its options included, see test_bad_input.py) is the same call.
    same = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                            tool="lookup_order", arguments={"order_id": "1001"},
                            expires_in=60)
    assert same == first


def test_expiry_after_an_attempt_reached_the_tool_is_not_did_not_run(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a worker whose retry backoff is long (1-2 s for the first retry)
    worker = start_worker(concurrency=2, extra_env={"DEX_RETRY_BACKOFF_BASE_SECONDS": "2",
                                                    "DEX_RETRY_BACKOFF_MAX_SECONDS": "2"})
    # And a read that fails transiently once, and an address update whose child is killed
    # mid-run, both allowed to wait in the queue for only a short while
    read = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                            tool="flaky_lookup", arguments={"order_id": "1001"},
                            expires_in=0.8)
    write = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                             tool="update_address",
                             arguments={"order_id": "1001", "address": "1 Main St",
                                        "sleep": 30},
                             expires_in=0.8)
    pid = wait_until(lambda: next((e["pid"] for e in ledger.read(ledger_path)
                                   if e["key"] == write.key), None), 20, "the write to start")
    assert pid in worker.children()
    expires_at = client.store.get_call(write.key).expires_at  # type: ignore[union-attr]
    wait_until(lambda: time.time() > expires_at + 0.05, 5, "the write's expiry to pass")
    os.kill(pid, signal.SIGKILL)

    # When their next attempt's message has expired before it starts
    final_read = client.wait(read.key, 20)
    final_write = client.wait(write.key, 20)

    # Then neither claims the tool did not run: it did, once each
    assert ledger.executions(ledger_path) == {read.key: 1, write.key: 1}
    assert final_read.status is CallStatus.FAILED
    assert final_read.attempts == 1
    assert not (final_read.error or "").startswith(PREFIX)
    assert "expired" in (final_read.error or "")
    # An interrupted write may have taken effect: its outcome is unknown.
    assert final_write.status is CallStatus.OUTCOME_UNKNOWN
    assert (final_write.error or "").startswith(OUTCOME_UNKNOWN_TOOL_RESULT)
    assert "expired" in (final_write.error or "")
    worker.kill_all()
