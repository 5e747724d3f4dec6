"""The session transcript: one tool message per ended call, whatever ended it; user messages
queued and delivered; the model's own text in order. Real workers, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

import workers.example_tools  # noqa: F401 - the tools are local here: arguments checked here
from dex_tasks import (
    OUTCOME_UNKNOWN_TOOL_RESULT,
    TOOL_DID_NOT_RUN,
    AsyncDexClient,
    CallStatus,
    DexClient,
    DexSettings,
    InvalidArgumentError,
    MessageRole,
    ToolCallRecord,
)
from dex_tasks.store import MESSAGES, deadlines
from dex_tasks.worker import sweeps
from dex_tasks.worker.execution import Runtime
from tests.conftest import StartWorker, fast_settings
from tests.helpers import started_pid, tool_messages, user_messages, wait_until


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    """This module's client, workers and sweeps use SQLite and PostgreSQL in turn."""
    return fast_settings(redis_url, database_url)


def call(client: DexClient, call_id: str, tool: str, turn: str = "t1",
         **arguments: object) -> ToolCallRecord:
    return client.call_tool(session_id="s1", turn_id=turn, tool_call_id=call_id, tool=tool,
                            arguments=arguments)


def tool_message_counts(client: DexClient) -> Counter[str]:
    with client.store.read() as conn:
        keys = conn.execute(MESSAGES.select().where(
            MESSAGES.c.role == MessageRole.TOOL.value)).mappings()
        return Counter(str(row["key"]) for row in keys)


def test_every_path_that_ends_a_call_writes_its_tool_message_once(
    client: DexClient, start_worker: StartWorker, rt: Runtime, ledger_path: Path,
) -> None:
    worker = start_worker(concurrency=2)
    ended: dict[str, str] = {}  # key -> how it ended

    # A worker's success and a tool's failure
    ok = call(client, "ok", "lookup_order", order_id="1001")
    ended[ok.key] = "worker success"
    bad = call(client, "bad", "broken_report", report="q3")
    ended[bad.key] = "tool failure"
    # A single-attempt child SIGKILLed mid-charge: outcome_unknown from the main process
    killed = call(client, "killed", "charge_card", customer_id="cu_1", amount_cents=100,
                  sleep=30)
    os.kill(started_pid(ledger_path, killed.key), signal.SIGKILL)
    ended[killed.key] = "child killed"
    # Did not run: invalid arguments (checked in the client, the tool being local here)
    invalid = call(client, "invalid", "charge_card", customer_id="cu_1", amount_cents="lots")
    ended[invalid.key] = "invalid arguments"
    # A person's rejection and an approval deadline passing
    refused = call(client, "refused", "refund_payment", turn="t2", charge_id="ch_1",
                   amount_cents=5)
    assert refused.interrupt_id is not None
    assert client.resolve_interrupt("s1", refused.interrupt_id, False,
                                    rejection_message="not this one", approver="ann")
    ended[refused.key] = "rejected"
    overdue = client.call_tool(session_id="s1", turn_id="t3", tool_call_id="overdue",
                               tool="refund_payment",
                               arguments={"charge_id": "ch_2", "amount_cents": 5},
                               approval_deadline=60)
    assert deadlines.expire_overdue(client.store, now=time.time() + 120) == 1
    ended[overdue.key] = "deadline"
    for key in (ok.key, bad.key, killed.key):
        client.wait(key, timeout=30)

    # The lease reaper: the whole worker disappears while a charge runs
    reaped = call(client, "reaped", "charge_card", customer_id="cu_2", amount_cents=200,
                  sleep=60)
    started_pid(ledger_path, reaped.key)
    worker.kill_all()
    assert sweeps.reap_expired_leases(rt, now=time.time() + 600) == 1
    ended[reaped.key] = "lease reaper"
    # Did not run: expired in the queue, ended by the sweep of calls no live worker serves
    expired = client.call_tool(session_id="s1", turn_id="t4", tool_call_id="expired",
                               tool="lookup_order", arguments={"order_id": "1001"},
                               expires_in=60)
    rt.redis.flushdb()
    # (It ends nothing until a freshly started Redis has been up for one announcement lifetime:
    # before that it cannot tell a tool nobody serves from a worker that has not announced yet.)
    wait_until(lambda: sweeps.expire_unserved(rt, now=time.time() + 120) == 1, 30,
               "the unserved expired call to be ended")
    ended[expired.key] = "expired in the queue"
    # A call still waiting for a person, which must have no tool message
    waiting = call(client, "waiting", "refund_payment", turn="t5", charge_id="ch_3",
                   amount_cents=5)

    # Then every ended call has exactly one tool message, which says how the call ended
    snapshot = client.get_agent_snapshot("s1")
    by_key = {m.key: m for m in tool_messages(snapshot)}
    assert set(by_key) == set(ended), "tool messages do not match the ended calls"
    assert tool_message_counts(client) == Counter(dict.fromkeys(ended, 1))
    calls = {c.key: c for c in snapshot.tool_calls}
    for key, how in ended.items():
        message, record = by_key[key], calls[key]
        assert record.terminal, how
        assert message.call_status is record.status, how
        assert message.text is None and message.status is None, how
        assert (message.turn_id, message.tool_call_id, message.tool) == (
            record.turn_id, record.tool_call_id, record.tool), how
        assert json.loads(message.tool_arguments or "") == record.arguments, how
        assert message.created_at == record.finished_at, how
        if record.status is CallStatus.SUCCEEDED:
            assert json.loads(message.tool_output or "") == record.result, how
        else:
            assert message.tool_output == record.error, how
    assert calls[ok.key].status is CallStatus.SUCCEEDED
    assert json.loads(by_key[ok.key].tool_output or "")["order_id"] == "1001"
    assert "does not exist" in (by_key[bad.key].tool_output or "")
    for key in (killed.key, reaped.key):
        assert OUTCOME_UNKNOWN_TOOL_RESULT in (by_key[key].tool_output or "")
    for key in (invalid.key, expired.key):
        assert (by_key[key].tool_output or "").startswith(TOOL_DID_NOT_RUN)
    assert "not this one" in (by_key[refused.key].tool_output or "")
    assert "deadline" in (by_key[overdue.key].tool_output or "")
    assert waiting.key not in by_key

    # When everything that could end a call runs again, nothing is added
    assert not client.store.transition(ok.key, CallStatus.FAILED, values={"error": "again"})
    assert not client.resolve_interrupt("s1", refused.interrupt_id, True)
    assert sweeps.run_all(rt, now=time.time() + 600)["expire_approvals"] == 0
    assert tool_message_counts(client) == Counter(dict.fromkeys(ended, 1))


def test_the_unique_key_refuses_a_second_tool_message(client: DexClient) -> None:
    # The guarded transition writes one; the index is the backstop if code ever tried again
    record = call(client, "c1", "refund_payment", charge_id="ch_1", amount_cents=5)
    assert record.interrupt_id is not None
    assert client.resolve_interrupt("s1", record.interrupt_id, False)
    with pytest.raises(IntegrityError), client.store.write() as conn:
        conn.execute(insert(MESSAGES).values(
            session_id="s1", role=MessageRole.TOOL.value, key=record.key,
            call_status="rejected", created_at=time.time()))
    assert tool_message_counts(client) == {record.key: 1}


def test_the_transcript_is_the_whole_conversation_in_order(
    settings: DexSettings, start_worker: StartWorker
) -> None:
    start_worker(concurrency=2)

    async def agent() -> list[tuple[str, str | None, str | None]]:
        async with AsyncDexClient(settings) as client:
            # Turn 1: the model says something, then reads an order
            await client.add_assistant_message("s1", "t1", "Let me look up order 1001.")
            read = await client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                          tool="lookup_order", arguments={"order_id": "1001"})
            await client.wait(read.key, timeout=30)
            # Turn 2: a refund waits for approval; the user writes meanwhile
            refund = await client.call_tool(session_id="s1", turn_id="t2", tool_call_id="c1",
                                            tool="refund_payment",
                                            arguments={"charge_id": "ch_1", "amount_cents": 5})
            assert await client.send_user_message("s1", "and refund the shipping") is True
            snapshot = await client.get_agent_snapshot("s1")
            assert [m.status for m in user_messages(snapshot)] == ["queued"]
            assert refund.interrupt_id is not None
            assert await client.resolve_interrupt("s1", refund.interrupt_id, True)
            await client.wait(refund.key, timeout=30)
            # The turn's end delivered the message; the model answers
            snapshot = await client.get_agent_snapshot("s1")
            [user] = user_messages(snapshot)
            assert user.status == "delivered" and user.delivered_at is not None
            stored = await client.add_assistant_message("s1", "t3", "Refunded, shipping too.")
            assert stored.role is MessageRole.ASSISTANT and stored.turn_id == "t3"
            snapshot = await client.get_agent_snapshot("s1")
            return [(m.role.value, m.turn_id, m.text or m.tool) for m in snapshot.messages]

    # The user's message waited for turn 2 and is read after its last tool message (issue 18)
    assert asyncio.run(agent()) == [
        ("assistant", "t1", "Let me look up order 1001."),
        ("tool", "t1", "lookup_order"),
        ("tool", "t2", "refund_payment"),
        ("user", None, "and refund the shipping"),
        ("assistant", "t3", "Refunded, shipping too."),
    ]


def test_bad_assistant_message_input_names_the_field(client: DexClient) -> None:
    for session_id, turn_id, text, field in (
        ("s1", "t1", "", "text"), ("s1", "t1", None, "text"), ("s1", "", "hi", "turn_id"),
        ("s1", "t/1", "hi", "turn_id"), ("s1", 7, "hi", "turn_id"), ("", "t1", "hi", "session_id"),
        (None, "t1", "hi", "session_id"),
    ):
        with pytest.raises(InvalidArgumentError, match=field):
            client.add_assistant_message(session_id, turn_id, text)  # type: ignore[arg-type]
    assert client.get_agent_snapshot("s1").messages == []
