"""A waiter is handed the ended record with the notification that wakes it (DESIGN version 4):
``wait`` reads the store once before it subscribes and not again once woken, and a record in
a notification counts only when it is signed with the store's own key (``Store.shared_key``),
which needs no setting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from itsdangerous import BadSignature, Serializer

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.broker.ended import (
    RECORD_SALT,
    ended_channel,
    ended_message,
    ended_record,
    record_serializer,
)
from dex_tasks.store import EndedCall
from dex_tasks.store.records import ToolCallRecord
from dex_tasks.store.sqljson import canonical_text
from tests.conftest import StartWorker, fast_settings
from tests.helpers import open_store, wait_until
from tests.test_store import call_row
from workers import ledger

TOOLS = "workers.example_tools,chaos.tools"


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    # No poll while the test waits: every read of the store is one the wake-ups asked for.
    # And no DEX_SECRET_KEY on either side: records are signed with the store's own key,
    # which a deployment without the API never sets.
    return fast_settings(redis_url, database_url, wait_poll_seconds=60.0, secret_key=None)


def _timed_reads(client: DexClient, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each read of a call by ``client`` ended."""
    reads: list[float] = []
    original: Callable[..., Any] = client.store.get_call_columns

    def get_call(key: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(key, *args, **kwargs)
        finally:
            reads.append(time.time())

    monkeypatch.setattr(client.store, "get_call_columns", get_call)
    return reads


def _running_read(client: DexClient, start_worker: StartWorker, ledger_path: Path,
                  sleep: float) -> str:
    """The key of a read a worker has started, whose first attempt takes ``sleep`` seconds."""
    start_worker(concurrency=1, tools=TOOLS)
    key = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                           tool="stall_first_attempt",
                           arguments={"order_id": "7", "sleep": sleep}).key
    wait_until(lambda: len(ledger.read(ledger_path)) == 1, 30, "the tool to start")
    return key


def test_wait_takes_the_ended_record_from_the_notification_without_reading_the_store(
    client: DexClient, start_worker: StartWorker, ledger_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a read that is running when the waiter starts waiting
    key = _running_read(client, start_worker, ledger_path, sleep=1)
    reads = _timed_reads(client, monkeypatch)

    # When it waits for the call to end
    ended = client.wait(key, 30)

    # Then every read of the store it made came before the call ended (the one before it
    # subscribed, and the one once its subscription was confirmed): the ending itself came
    # with the notification...
    monkeypatch.undo()
    finished = client.store.get_call(key).finished_at  # type: ignore[union-attr]
    assert finished is not None and 1 <= len(reads) <= 2
    assert all(at < finished for at in reads), (reads, finished)
    # ...and is exactly the stored record
    assert ended == client.get_tool_call(key)
    assert ended.status is CallStatus.SUCCEEDED and ended.result == {"order_id": "7",
                                                                     "attempt": 1}


def test_a_record_not_signed_with_the_stores_key_is_not_believed(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, redis_url: str,
) -> None:
    # Given a read that runs for a few seconds
    key = _running_read(client, start_worker, ledger_path, sleep=3)
    stored = client.store.get_call(key)
    assert stored is not None
    forged = {**stored.model_dump(), "status": "succeeded", "result": '{"forged": true}',
              "finished_at": stored.created_at + 1}
    publisher = redis.Redis.from_url(redis_url)

    # When someone with Redis access but another key keeps announcing a made-up ending
    # while the waiter waits
    stop = threading.Event()
    forgery = record_serializer("not-the-stores-key").dumps(forged)

    def forge() -> None:
        while not stop.wait(0.05):
            publisher.publish(ended_channel(key), forgery)

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        ended = client.wait(key, 30)
    finally:
        stop.set()
        forger.join()

    # Then the waiter waited for the real ending
    assert ended.status is CallStatus.SUCCEEDED and ended.result == {"order_id": "7",
                                                                     "attempt": 1}


def test_a_record_is_signed_as_itsdangerous_signs_it_so_either_release_reads_it() -> None:
    # Given the serializer of ended records (its signer made once, its key derived once) and
    # itsdangerous' own with the same key and salt (what a worker of an earlier release signs
    # and checks with, during a rolling upgrade)
    ours = record_serializer("the store's key")
    theirs = Serializer("the store's key", salt=RECORD_SALT)
    record = {"key": "s/t/é", "status": "succeeded", "result": '{"n": 1}', "attempts": 2,
              "finished_at": 1_700_000_000.125, "error": None}

    # When records are signed, over and over, with both
    signed = [ours.dumps(record) for _ in range(3)]

    # Then the signatures are the same, and each side reads the other's
    assert signed == [theirs.dumps(record)] * 3
    assert theirs.loads(signed[0]) == ours.loads(theirs.dumps(record)) == record

    # And a record signed with another key, or with another salt, is refused, as before
    for forged in (Serializer("another key", salt=RECORD_SALT).dumps(record),
                   Serializer("the store's key", salt="another salt").dumps(record)):
        with pytest.raises(BadSignature):
            ours.loads(forged)


# Values whose JSON or number text differs between what the store reads back and what a
# statement may write out: escapes, characters outside ASCII, numbers jsonb respells, JSON
# null against SQL NULL, whole and fractional timestamps.
_ODD_JSON = {"quote": "a\"b\\c\nd\te\u0001", "café": "日本 😀",
             "n": [0.1, 1e20, -0.0, 2**70, 1.5e-7], "nested": {"b": [], "a": {}},
             "none": None, "yes": True}


@pytest.mark.parametrize(("status", "values", "at"), [
    (CallStatus.SUCCEEDED, {"result": canonical_text(_ODD_JSON)}, 1_700_000_000.0),
    (CallStatus.SUCCEEDED, {"result": "null"}, 1_700_000_000.123456),
    (CallStatus.FAILED, {"error": "boom: \"x\"\n\u0007 ü"}, 1_712_345_678.987654321),
])
def test_the_record_an_ending_hands_over_is_the_stored_record(
    database_url: str, status: CallStatus, values: dict[str, Any], at: float,
) -> None:
    # Given a running call whose arguments, result or error hold odd JSON and text, with
    # whole or fractional timestamps
    key = f"s/t/{status.value}-{at}"
    with open_store(database_url) as store:
        assert store.insert_call(call_row(
            key, CallStatus.QUEUED, arguments=canonical_text(_ODD_JSON), created_at=at - 1,
            requires_approval=True, original_arguments=canonical_text({"x": 1.25}),
            approval_rule=canonical_text({"rule": "ü", "n": None})))
        assert store.transition(key, CallStatus.RUNNING, values={"worker": "w:1"})
        ended: list[EndedCall] = []
        store.on_calls_ended(ended.extend)

        # When it ends, and its end is announced with its record signed
        assert store.transition(key, status, allowed={CallStatus.RUNNING}, values=values,
                                now=at)
        (call,) = ended
        signer = record_serializer("the store's key")
        record = ended_record(ended_message(call, signer), signer, key)

        # Then a waiter handed that record has exactly the record a read of the store gives
        assert record is not None and call.worker == "w:1"
        stored = store.get_call_columns(key)
        assert stored is not None
        assert ToolCallRecord.from_mapping(record) == ToolCallRecord.from_mapping(stored)
