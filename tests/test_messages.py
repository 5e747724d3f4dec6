"""Turns and messages: a user message sent while a turn is open waits until the turn is over.

Store-level tests on SQLite and PostgreSQL. Calls are ended by a person's decision, by the
deadline sweep, or by the store transitions a worker makes; the end-to-end path through a
real worker is in ``test_approvals.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import insert

import workers.example_tools  # noqa: F401 - registers refund_payment (needs approval) here
from dex_tasks import (
    CallStatus,
    DexClient,
    InvalidArgumentError,
    ToolCallRecord,
)
from dex_tasks.store import MESSAGES, deadlines, transcript
from tests.conftest import fast_settings
from tests.helpers import user_messages


@pytest.fixture
def db_client(redis_url: str, database_url: str) -> Iterator[DexClient]:
    with DexClient(fast_settings(redis_url, database_url)) as c:
        yield c


def pending(client: DexClient, turn: str, call: str, session: str = "s1",
            **kwargs: float) -> ToolCallRecord:
    record = client.call_tool(session_id=session, turn_id=turn, tool_call_id=call,
                              tool="refund_payment",
                              arguments={"charge_id": f"ch_{call}", "amount_cents": 100},
                              **kwargs)
    assert record.status is CallStatus.AWAITING_APPROVAL
    return record


def reject(client: DexClient, record: ToolCallRecord) -> None:
    assert record.interrupt_id is not None
    assert client.resolve_interrupt(record.session_id, record.interrupt_id, False)


def statuses(client: DexClient, session: str = "s1") -> list[str]:
    return [m.status for m in user_messages(client.get_agent_snapshot(session))]


def test_message_with_no_open_turn_is_delivered_at_once(db_client: DexClient) -> None:
    assert db_client.send_user_message("s1", "hello") is True
    [sent] = user_messages(db_client.get_agent_snapshot("s1"))
    assert sent.status == "delivered" and sent.delivered_at is not None
    # A turn open in another session does not hold it either.
    pending(db_client, "t1", "c1", session="s2")
    assert db_client.send_user_message("s1", "again") is True
    assert statuses(db_client) == ["delivered", "delivered"]
    [first, second] = user_messages(db_client.get_agent_snapshot("s1"))
    assert (first.text, second.text) == ("hello", "again")


def test_message_waits_until_every_call_of_the_open_turn_is_terminal(
    db_client: DexClient,
) -> None:
    # Given a turn with two calls awaiting approval, and a message sent during it
    first = pending(db_client, "t1", "c1")
    second = pending(db_client, "t1", "c2")
    assert db_client.send_user_message("s1", "wait, use the other card")
    [sent] = user_messages(db_client.get_agent_snapshot("s1"))
    assert sent.status == "queued" and sent.delivered_at is None

    # When one call ends, and the other is approved (queued, then running)
    reject(db_client, first)
    assert statuses(db_client) == ["queued"]
    assert second.interrupt_id is not None
    assert db_client.resolve_interrupt("s1", second.interrupt_id, True)
    assert statuses(db_client) == ["queued"]
    store = db_client.store
    assert store.transition(second.key, CallStatus.RUNNING, values={"worker": "w:1"})
    assert statuses(db_client) == ["queued"]

    # Then the message is delivered by the transition that ends the turn's last call
    assert store.transition(second.key, CallStatus.SUCCEEDED, values={"result": "{}"})
    [message] = user_messages(db_client.get_agent_snapshot("s1"))
    assert message.status == "delivered"
    assert message.delivered_at == db_client.get_tool_call(second.key).finished_at


def test_a_call_added_to_the_open_turn_holds_its_message(db_client: DexClient) -> None:
    first = pending(db_client, "t1", "c1")
    db_client.send_user_message("s1", "one more thing")
    later = pending(db_client, "t1", "c2")  # the same turn asks for another call
    reject(db_client, first)
    assert statuses(db_client) == ["queued"]
    reject(db_client, later)
    assert statuses(db_client) == ["delivered"]


def test_a_turn_begun_after_the_message_does_not_hold_it(db_client: DexClient) -> None:
    # Given a message sent during turn t1, and a turn t2 begun after it
    t1 = pending(db_client, "t1", "c1")
    db_client.send_user_message("s1", "first")
    t2 = pending(db_client, "t2", "c1")

    # When t1 ends, its message is delivered though t2 is open; one sent now waits for t2
    reject(db_client, t1)
    assert statuses(db_client) == ["delivered"]
    assert db_client.send_user_message("s1", "second")
    assert statuses(db_client) == ["delivered", "queued"]
    reject(db_client, t2)
    assert statuses(db_client) == ["delivered", "delivered"]


def test_the_deadline_sweep_ending_a_turn_delivers_its_message(db_client: DexClient) -> None:
    pending(db_client, "t1", "c1", approval_deadline=60)
    db_client.send_user_message("s1", "are you there?")
    assert deadlines.expire_overdue(db_client.store, now=time.time() + 120) == 1
    assert statuses(db_client) == ["delivered"]


def test_deliver_messages_sweep_delivers_what_a_race_left_queued(db_client: DexClient) -> None:
    # Given a queued message whose turn is over (as a send racing the turn's end can leave it
    # on PostgreSQL), and one whose turn is still open
    open_call = pending(db_client, "t1", "c1", session="s2")
    db_client.send_user_message("s2", "still waiting")
    now = time.time()
    with db_client.store.write() as conn:
        conn.execute(insert(MESSAGES).values(session_id="s1", text="stranded",
                                             status="queued", created_at=now))

    # When the sweep runs, only the one whose turn is over is delivered, once
    assert transcript.deliver_messages(db_client.store) == 1
    assert statuses(db_client, "s1") == ["delivered"]
    assert statuses(db_client, "s2") == ["queued"]
    assert transcript.deliver_messages(db_client.store) == 0
    reject(db_client, open_call)
    assert statuses(db_client, "s2") == ["delivered"]


def _at_once(*actions: Callable[[], object]) -> None:
    barrier = threading.Barrier(len(actions))

    def run(action: Callable[[], object]) -> None:
        barrier.wait()
        action()

    threads = [threading.Thread(target=run, args=(a,)) for a in actions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_message_sent_as_its_turn_ends_is_delivered_without_the_sweep(
    db_client: DexClient,
) -> None:
    # Given turns ending at the same moment as a message is sent (on PostgreSQL neither
    # transaction sees the other's uncommitted change unless delivery serialises them)
    for i in range(8):
        record = pending(db_client, f"t{i}", "c1")
        _at_once(lambda i=i: db_client.send_user_message("s1", f"message {i}"),
                 lambda record=record: reject(db_client, record))
    # Then every message is delivered with no sweep having run
    assert statuses(db_client) == ["delivered"] * 8


def test_a_turn_whose_last_two_calls_end_at_once_delivers_its_message(
    db_client: DexClient,
) -> None:
    for i in range(6):
        first, second = pending(db_client, f"t{i}", "c1"), pending(db_client, f"t{i}", "c2")
        db_client.send_user_message("s1", f"message {i}")
        _at_once(lambda first=first: reject(db_client, first),
                 lambda second=second: reject(db_client, second))
        assert statuses(db_client)[-1] == "delivered", f"round {i}"


def test_bad_message_input_names_the_field(client: DexClient) -> None:
    for session_id, text, field in (("s1", "", "text"), ("s1", 5, "text"),
                                    ("", "hi", "session_id"), (None, "hi", "session_id")):
        with pytest.raises(InvalidArgumentError, match=field):
            client.send_user_message(session_id, text)  # type: ignore[arg-type]
    assert client.get_agent_snapshot("s1").messages == []
