"""Bad ids and arguments are refused up front, and a row no sweep can read does not stop the
sweeps from recovering every other call (issue 11, items 1, 11 and 17).
"""

from __future__ import annotations

import math
import time
from datetime import date
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, update

from dex_tasks import (
    CallStatus,
    ConflictError,
    DexClient,
    DexSettings,
    InvalidArgumentError,
    InvalidCallError,
)
from dex_tasks.broker.routing import queue_for
from dex_tasks.store import CALLS
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker, fast_settings
from workers import example_tools, ledger

assert example_tools.lookup_order.name == "lookup_order"

LONG = "x" * 201


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    """Every test here runs on SQLite and on PostgreSQL: before these checks an overlong id
    was stored unreadable by SQLite and refused by PostgreSQL as a store failure."""
    return fast_settings(redis_url, database_url)


@pytest.mark.parametrize(
    ("ids", "tool", "field", "says"),
    [
        ((LONG, "t1", "c1"), "lookup_order", "session_id", "at most 200 characters, got 201"),
        (("s1", LONG, "c1"), "lookup_order", "turn_id", "at most 200 characters, got 201"),
        (("s1", "t1", LONG), "lookup_order", "tool_call_id", "at most 200 characters, got 201"),
        (("s" * 200, "t" * 200, "c" * 200), "lookup_order", "idempotency key",
         "at most 512 characters, got 602"),
        (("s\x001", "t1", "c1"), "lookup_order", "session_id", "NUL"),
        (("s1", "t\ud8001", "c1"), "lookup_order", "turn_id", "lone surrogate"),
        (("s1", "t1", "c1"), "x" * 201, "tool", "at most 200 characters, got 201"),
        (("s1", "t1", "c1"), "look\x00up", "tool", "NUL"),
    ],
)
def test_malformed_ids_are_refused_naming_the_field_and_the_limit(
    client: DexClient, ids: tuple[str, str, str], tool: str, field: str, says: str
) -> None:
    session_id, turn_id, tool_call_id = ids
    with pytest.raises(InvalidCallError) as caught:
        client.call_tool(session_id=session_id, turn_id=turn_id, tool_call_id=tool_call_id,
                             tool=tool, arguments={"order_id": "1001"})
    assert field in str(caught.value) and says in str(caught.value)
    # Nothing was written: the store holds no call at all.
    with client.store.read() as conn:
        assert conn.execute(CALLS.select()).first() is None


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"order_id": date(2024, 1, 1)}, "arguments.order_id is a date"),
        ({"order_id": object()}, "arguments.order_id is a object"),
        ({"order_id": "1", "extra": {"n": math.nan}}, "arguments.extra.n is nan"),
        ({"order_id": "1", "extra": [1, math.inf]}, "arguments.extra[1] is inf"),
        ({"order_id": "1", "extra": {1: "a"}}, "key 1 of type int"),
        # Strings the store cannot hold, as values and as keys, ASCII or not, nested.
        ({"order_id": "1", "extra": {"note": "a\x00b"}}, "arguments.extra.note contains a NUL"),
        ({"order_id": "1", "extra": ["é", "\ud800"]}, "arguments.extra[1] contains a lone"),
        ({"order_id": "1", "extra": {"k\ud800": 1}}, "a key of arguments.extra contains a lone"),
        ({"order_id": "1", "extra": ({"\x00": 1},)}, "a key of arguments.extra[0] contains a NUL"),
    ],
)
def test_arguments_that_are_not_plain_json_are_refused(
    client: DexClient, arguments: dict[str, Any], says: str
) -> None:
    # A date would have become a string equal to the string "2024-01-01", an object() text
    # with an address in it, NaN a value the API reads back as null.
    with pytest.raises(InvalidCallError, match="arguments") as caught:
        client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                         tool="lookup_order", arguments=arguments)
    assert says in str(caught.value)
    assert client.get_agent_snapshot("s1").tool_calls == []


def test_malformed_ids_of_messages_and_decisions_are_refused(client: DexClient) -> None:
    with pytest.raises(InvalidArgumentError, match=r"session_id.*at most 200"):
        client.send_user_message(LONG, "hello")
    with pytest.raises(InvalidArgumentError, match=r"text.*NUL"):
        client.send_user_message("s1", "hel\x00lo")
    with pytest.raises(InvalidArgumentError, match=r"interrupt_id.*at most 64"):
        client.resolve_interrupt("s1", "i" * 65, approved=True)
    with pytest.raises(InvalidArgumentError, match=r"rejection_message.*NUL"):
        client.resolve_interrupt("s1", "i1", approved=False, rejection_message="no\x00")


def _bad_row(key: str, status: CallStatus, now: float, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key, "session_id": "bad", "turn_id": "t", "tool_call_id": "c",
        "tool": "lookup_order", "arguments": "{}", "effect": "read",
        "requires_approval": False, "max_attempts": 3, "status": status.value,
        "attempts": 0, "republishes": 0, "created_at": now - 600, "updated_at": now - 600,
        "published_at": None, "worker": None, "lease_expires_at": None,
    }
    row.update(values)
    return row


def test_a_row_no_sweep_can_read_does_not_stop_recovery_of_the_others(
    client: DexClient, rt: Runtime, start_worker: StartWorker, ledger_path: Path,
    database_url: str,
) -> None:
    # Given a read whose message was lost in Redis...
    lost = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="lost",
                            tool="lookup_order", arguments={"order_id": "1001"})
    # ...and a read whose worker vanished while it ran (claimed, lease long expired)...
    orphan = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="orphan",
                              tool="lookup_order", arguments={"order_id": "1002"})
    assert rt.redis.delete(queue_for("lookup_order")) == 1
    assert client.store.transition(
        orphan.key, CallStatus.RUNNING, allowed={CallStatus.QUEUED},
        values={"attempts": 1, "worker": "dex-gone@nowhere:2",
                "lease_expires_at": time.time() - 600})
    # ...and rows no code can handle, queued with a long-stale publish and running with a
    # long-expired lease: an effect class that does not exist (both stores) and, on SQLite
    # (which does not enforce column widths), a key longer than its column, which an older
    # release let through.
    now = time.time()
    bad = [
        _bad_row("bad/t/queued", CallStatus.QUEUED, now, effect="bogus",
                 published_at=now - 600),
        _bad_row("bad/t/running", CallStatus.RUNNING, now, effect="bogus", attempts=1,
                 worker="dex-gone@nowhere:1", lease_expires_at=now - 600),
    ]
    if database_url.startswith("sqlite"):
        bad.append(_bad_row("bad/t/" + "k" * 600, CallStatus.QUEUED, now,
                            published_at=now - 600))
        bad.append(_bad_row("bad/t/" + "r" * 600, CallStatus.RUNNING, now, attempts=1,
                            worker="dex-gone@nowhere:1", lease_expires_at=now - 600))
    client.store.flush_publish_marks()  # call_tool's own mark must land before this one
    with client.store.write() as conn:
        conn.execute(insert(CALLS), bad)
        conn.execute(update(CALLS).where(CALLS.c.key == lost.key)
                     .values(published_at=now - 600))

    # When the sweeps run (each batch meets the bad rows first or among the good ones) while
    # a worker serves the tool (the republisher sends nothing to a queue nobody consumes)
    start_worker(concurrency=1)
    assert run_job(rt, "republish_stranded") == 1
    assert run_job(rt, "reap_expired_leases") == 1

    # Then the lost read is sent again and the orphan retried, and both run once here
    assert client.wait(lost.key, 30).status is CallStatus.SUCCEEDED
    assert client.wait(orphan.key, 30).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path) == {lost.key: 1, orphan.key: 1}


@pytest.mark.parametrize(
    ("first", "again", "field"),
    [
        ({"default_effect": "read"}, {"default_effect": "non_idempotent_write"},
         "default_effect"),
        ({}, {"default_effect": "read"}, "default_effect"),
        ({"approval_deadline": 60}, {"approval_deadline": 120}, "approval_deadline"),
        ({"expires_in": 30}, {}, "expires_in"),
    ],
)
def test_a_repeat_with_other_options_is_a_conflict_not_the_old_record(
    client: DexClient, first: dict[str, Any], again: dict[str, Any], field: str
) -> None:
    # The same key with another session default, deadline or expiry is another request: it
    # used to get the first request's record back, silently.
    ids = {"session_id": "s1", "turn_id": "t1", "tool_call_id": "c1"}
    original = client.call_tool(**ids, tool="lookup_order", arguments={"order_id": "1001"},
                                **first)
    # The very same request again is a retry: the same record
    assert client.call_tool(**ids, tool="lookup_order", arguments={"order_id": "1001"},
                            **first).key == original.key
    with pytest.raises(ConflictError) as caught:
        client.call_tool(**ids, tool="lookup_order", arguments={"order_id": "1001"}, **again)
    assert caught.value.field == field
    # and call_tools keeps the same rule, for the whole batch
    with pytest.raises(ConflictError, match=field):
        client.call_tools([{"tool_call_id": "c1", "tool": "lookup_order",
                            "arguments": {"order_id": "1001"}},
                           {"tool_call_id": "c2", "tool": "lookup_order",
                            "arguments": {"order_id": "1002"}}],
                          session_id="s1", turn_id="t1", **again)
    assert [c.key for c in client.get_agent_snapshot("s1").tool_calls] == [original.key]
