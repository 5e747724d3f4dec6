"""Group commit of ends in one worker process (DESIGN version 4): the endings of several threads
that come together share one commit, each still its own guarded move, and the calls they end
are announced only once that commit is done."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Connection

from dex_tasks import CallStatus
from dex_tasks.store import EndedCall, Store
from dex_tasks.worker.group_commit import EndCommits
from tests.helpers import open_store
from tests.test_store import call_row

THREADS = 8


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    with open_store(database_url) as s:
        yield s


def test_endings_that_come_together_share_one_commit_and_are_announced_after_it(
    store: Store, database_url: str,
) -> None:
    # Given eight running calls of one process, and a count of the store's commits
    keys = [f"s/t/c{i}" for i in range(THREADS)]
    for key in keys:
        store.insert_call(call_row(key, CallStatus.QUEUED))
        assert store.transition(key, CallStatus.RUNNING, values={"worker": "w:1"})
    commits: list[int] = []
    event.listen(store.engine, "commit", lambda _conn: commits.append(1))
    # ...and a hook that reads each call it is told of through another connection
    reader = Store(database_url)
    announced: dict[str, str] = {}

    def hook(ended: Any) -> None:
        for call in ended:
            assert isinstance(call, EndedCall)
            row = reader.get_call(call.key)
            announced[call.key] = row.status if row is not None else "missing"

    store.on_calls_ended(hook)
    ends = EndCommits(store, hold=0.5)
    barrier = threading.Barrier(THREADS)
    won: dict[str, bool] = {}

    def end(key: str) -> None:
        ends.started()
        barrier.wait()

        def move(conn: Connection | None = None) -> bool:
            return store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                                    match={"worker": "w:1"}, values={"result": "1"},
                                    conn=conn)

        won[key] = ends.commit(move, move)

    # When their threads end them at about the same time
    commits.clear()
    threads = [threading.Thread(target=end, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    reader.close()

    # Then each won its own guarded move, in fewer commits than calls...
    assert won == dict.fromkeys(keys, True)
    assert 1 <= len(commits) < THREADS, commits
    # ...each call ended once, and every announcement came after its commit
    assert announced == dict.fromkeys(keys, CallStatus.SUCCEEDED.value)
    for key in keys:
        assert [e.event for e in store.events_for_call(key)][-1] == "tool_call_finished"
    # An ending that finds the call ended already loses, alone as grouped
    again = ends.commit(lambda conn=None: store.transition(
        keys[0], CallStatus.FAILED, allowed={CallStatus.RUNNING}, conn=conn),
        lambda: store.transition(keys[0], CallStatus.FAILED, allowed={CallStatus.RUNNING}))
    assert again is False


def test_an_ending_alone_in_its_process_is_not_held(store: Store) -> None:
    # Given one running call and a long hold
    store.insert_call(call_row("s/t/c", CallStatus.QUEUED))
    assert store.transition("s/t/c", CallStatus.RUNNING, values={"worker": "w:1"})
    ends = EndCommits(store, hold=30.0)
    ends.started()
    # When it ends with nothing else running in the process, it commits at once (alone)
    used: list[str] = []

    def grouped(conn: Connection) -> bool:
        used.append("grouped")
        return False

    def alone() -> bool:
        used.append("alone")
        return store.transition("s/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                                values={"result": "1"})

    assert ends.commit(grouped, alone) is True
    assert used == ["alone"]
