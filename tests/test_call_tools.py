"""call_tools: a turn's parallel calls in one store transaction and one Redis round trip, with
call_tool's rules per call, and all or nothing when any request is refused."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis.connection import AbstractConnection
from sqlalchemy import event

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from dex_tasks import (
    CallStatus,
    ConflictError,
    DexClient,
    InvalidCallError,
    ToolCallRequest,
    UnknownToolError,
)
from dex_tasks.broker.ended import RECORD_KEY_NAME
from dex_tasks.broker.routing import TOOL_QUEUE_PREFIX
from dex_tasks.states import TOOL_DID_NOT_RUN
from dex_tasks.worker.execution import Runtime
from tests.conftest import StartWorker, fast_settings
from tests.helpers import free_port
from workers import ledger

TURN = [
    ToolCallRequest(tool_call_id="a", tool="lookup_order", arguments={"order_id": "1001"}),
    ToolCallRequest(tool_call_id="b", tool="lookup_order", arguments={"order_id": "1002"}),
    {"tool_call_id": "c", "tool": "update_address",
     "arguments": {"order_id": "1001", "address": "1 Main St"}},
    {"tool_call_id": "d", "tool": "charge_card",
     "arguments": {"customer_id": "cu_1", "amount_cents": 500}},
    {"tool_call_id": "e", "tool": "refund_payment",
     "arguments": {"charge_id": "ch_1", "amount_cents": 500}},
]


class Sends:
    """Counts what Redis clients of this process send: writes, and LPUSH commands in them."""

    def __init__(self) -> None:
        self.writes_with_lpush: list[int] = []

    def __call__(self, original: Any) -> Any:
        def send(conn: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            data = command if isinstance(command, bytes) else b"".join(
                c if isinstance(c, bytes) else bytes(c) for c in command)
            pushes = data.count(b"\r\nLPUSH\r\n")
            if pushes:
                self.writes_with_lpush.append(pushes)
            return original(conn, command, *args, **kwargs)

        return send


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Sends:
    spy = Sends()
    monkeypatch.setattr(AbstractConnection, "send_packed_command",
                        spy(AbstractConnection.send_packed_command))
    return spy


@pytest.fixture
def commits(client: DexClient) -> Iterator[list[int]]:
    seen: list[int] = []

    def on_commit(_conn: Any) -> None:
        seen.append(1)

    event.listen(client.store.engine, "commit", on_commit)
    yield seen
    event.remove(client.store.engine, "commit", on_commit)


def _batch_commits(client: DexClient) -> int:
    """Commits of a batch and its publish mark (a statement in autocommit on PostgreSQL)."""
    return 2 if client.store.is_sqlite else 1


def _queued_messages(rt: Runtime) -> int:
    # Every tool has a queue of its own (routing.queue_for): count the messages in all of them.
    queues = rt.redis.keys(f"{TOOL_QUEUE_PREFIX}*")
    return sum(int(rt.redis.llen(queue)) for queue in queues)


def test_a_turn_is_recorded_in_one_transaction_and_sent_in_one_round_trip(
    client: DexClient, rt: Runtime, sends: Sends, commits: list[int]
) -> None:
    # When a model's five parallel calls are made at once
    records = client.call_tools(TURN, session_id="s1", turn_id="t1")
    # Then they were written in one transaction, and the four that start were sent in one
    # write to Redis (then one UPDATE, off the caller's path, records that they were sent: a
    # call with no publish time was recorded but never sent, issue 18; on PostgreSQL it is a
    # statement in autocommit); the refund waits for approval with its own interrupt, as
    # call_tool does
    client.store.flush_publish_marks()
    assert len(commits) == _batch_commits(client)
    assert sends.writes_with_lpush == [4]
    assert _queued_messages(rt) == 4
    assert [r.tool_call_id for r in records] == ["a", "b", "c", "d", "e"]
    assert [r.key for r in records] == [f"s1/t1/{c}" for c in "abcde"]
    assert [r.status for r in records] == [CallStatus.QUEUED] * 4 + [
        CallStatus.AWAITING_APPROVAL]
    assert records[4].interrupt_id is not None and records[3].interrupt_id is None
    assert [r.effect.value for r in records] == [
        "read", "read", "idempotent_write", "non_idempotent_write", "non_idempotent_write"]
    snapshot = client.get_agent_snapshot("s1")
    assert [c.key for c in snapshot.tool_calls] == [r.key for r in records]
    assert [p.key for p in snapshot.pending_interrupts] == [records[4].key]


def test_the_calls_run_once_each_on_real_workers(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    start_worker(concurrency=2)
    records = client.call_tools(TURN, session_id="s1", turn_id="t1")
    assert records[4].interrupt_id is not None
    assert client.resolve_interrupt("s1", records[4].interrupt_id, True)
    finals = [client.wait(r.key, timeout=30) for r in records]
    assert [f.status for f in finals] == [CallStatus.SUCCEEDED] * 5
    assert finals[3].result["charged_cents"] == 500
    # A repeat of the whole turn (an agent re-running its step) starts nothing again
    again = client.call_tools(TURN, session_id="s1", turn_id="t1")
    assert [a.status for a in again] == [CallStatus.SUCCEEDED] * 5
    assert ledger.executions(ledger_path) == {r.key: 1 for r in records}


def test_repeats_return_their_records_and_only_new_calls_are_sent(
    client: DexClient, rt: Runtime, sends: Sends
) -> None:
    first = client.call_tools(TURN[:2], session_id="s1", turn_id="t1")
    # When the turn is sent again with one more call
    again = client.call_tools(TURN[:3], session_id="s1", turn_id="t1")
    # Then the first two are the stored records, and only the new one is sent
    assert [r.key for r in again[:2]] == [r.key for r in first]
    assert [r.created_at for r in again[:2]] == [r.created_at for r in first]
    assert sends.writes_with_lpush == [2, 1]
    assert _queued_messages(rt) == 3


def test_a_conflicting_repeat_refuses_the_whole_batch(
    client: DexClient, rt: Runtime
) -> None:
    client.call_tools(TURN[:2], session_id="s1", turn_id="t1")
    before = _queued_messages(rt)
    # When one request reuses "b" with other arguments, beside a new call
    batch = [TURN[0], {"tool_call_id": "b", "tool": "lookup_order",
                       "arguments": {"order_id": "9999"}}, TURN[2]]
    with pytest.raises(ConflictError, match="s1/t1/b"):
        client.call_tools(batch, session_id="s1", turn_id="t1")
    # Then nothing of the batch was recorded or sent: the new call does not exist
    assert [c.tool_call_id for c in client.get_agent_snapshot("s1").tool_calls] == ["a", "b"]
    assert _queued_messages(rt) == before
    with pytest.raises(ConflictError, match="tool"):
        client.call_tools([{"tool_call_id": "a", "tool": "update_address",
                            "arguments": {"order_id": "1001"}}],
                          session_id="s1", turn_id="t1")


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ({"tool_call_id": "z"}, InvalidCallError, r"calls\[2\]\.tool: Field required"),
        ({"tool_call_id": "z", "tool": "lookup_order", "arguments": ["x"]}, InvalidCallError,
         r"calls\[2\]\.arguments"),
        ({"tool_call_id": "z", "tool": "lookup_order", "extra": 1}, InvalidCallError,
         r"calls\[2\]\.extra"),
        ({"tool_call_id": "a/b", "tool": "lookup_order"}, InvalidCallError,
         r"calls\[2\]: tool_call_id may not contain '/'"),
        ({"tool_call_id": "z", "tool": "lookup_order", "arguments": {"x": math.nan}},
         InvalidCallError, r"calls\[2\]: arguments.x is nan"),
        ({"tool_call_id": "a", "tool": "lookup_order", "arguments": {"order_id": "1"}},
         InvalidCallError, r"calls\[2\]: tool_call_id 'a' is already used by calls\[0\]"),
        ({"tool_call_id": "z", "tool": "no_such_tool"}, UnknownToolError, "no_such_tool"),
    ],
)
def test_a_refused_request_refuses_the_whole_batch(
    client: DexClient, rt: Runtime, bad: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        client.call_tools([*TURN[:2], bad], session_id="s1", turn_id="t1")
    assert client.get_agent_snapshot("s1").tool_calls == []
    assert _queued_messages(rt) == 0


def test_refused_shapes_of_the_batch_itself(client: DexClient) -> None:
    with pytest.raises(InvalidCallError, match="calls must be a list"):
        client.call_tools({"tool_call_id": "a"}, session_id="s1", turn_id="t1")  # type: ignore[arg-type]
    with pytest.raises(InvalidCallError, match="turn_id"):
        client.call_tools(TURN[:1], session_id="s1", turn_id="")
    assert client.call_tools([], session_id="s1", turn_id="t1") == []


def test_invalid_arguments_end_only_that_call_in_the_same_transaction(
    client: DexClient, rt: Runtime, commits: list[int]
) -> None:
    # The store's key for ended records is made once per store, by the first process that
    # ends a call (here the client, announcing the invalid call): made first, it is not
    # counted as the batch's.
    client.store.shared_key(RECORD_KEY_NAME)
    commits.clear()
    batch = [TURN[0], {"tool_call_id": "x", "tool": "lookup_order",
                       "arguments": {"order_id": 5}}]
    records = client.call_tools(batch, session_id="s1", turn_id="t1")
    client.store.flush_publish_marks()
    assert len(commits) == _batch_commits(client)  # the batch, the publish time of the one
    assert records[0].status is CallStatus.QUEUED
    assert records[1].status is CallStatus.FAILED
    assert (records[1].error or "").startswith(TOOL_DID_NOT_RUN)
    assert _queued_messages(rt) == 1


def test_an_unreachable_broker_ends_the_calls_to_start_did_not_run(sqlite_url: str) -> None:
    dead = fast_settings(f"redis://127.0.0.1:{free_port()}/0", sqlite_url)
    with DexClient(dead) as client:
        records = client.call_tools(TURN, session_id="s1", turn_id="t1")
    assert [r.status for r in records] == [CallStatus.FAILED] * 4 + [
        CallStatus.AWAITING_APPROVAL]
    for record in records[:4]:
        assert (record.error or "").startswith(TOOL_DID_NOT_RUN + ": the broker could not")


def test_the_same_turn_sent_twice_at_once_makes_each_call_once(
    client: DexClient, rt: Runtime
) -> None:
    start = threading.Barrier(4)

    def send(_: int) -> list[str]:
        start.wait()
        return [r.key for r in client.call_tools(TURN, session_id="s1", turn_id="t1")]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, range(4)))
    assert all(r == results[0] for r in results)
    assert len(client.get_agent_snapshot("s1").tool_calls) == 5
    assert _queued_messages(rt) == 4
