"""A dropped database connection loses no finished work (issue 11, item 3).

PostgreSQL is reached through a TCP proxy of our own (``tests/tcp_proxy.py``, its own process)
that the tests cut: every open connection is closed and new ones are refused for a while, as
when the server restarts. The proxy can also lose the answer to a COMMIT after the server has
committed, the one case where a client cannot tell whether its transaction happened.

Store-level tests first (each guarded transition run across a reconnect, the ambiguous
commit), then real workers whose store is cut while their tools run, then an idle client whose
connections the server closed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from dex_tasks import CallStatus, DexClient, DexSettings, StoreUnavailableError, idempotency_key
from dex_tasks.store import EndedCall, Move, Store
from tests.conftest import StartWorker, fast_settings
from tests.helpers import TcpProxy, calls_on_every_path, started_pid, wait_until
from tests.test_store import call_row
from workers import ledger

POSTGRES_PORT = "127.0.0.1:5432"


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    server = TcpProxy(POSTGRES_PORT).start()
    yield server
    server.stop()


@pytest.fixture
def proxied(postgres_url: str, proxy: TcpProxy) -> Iterator[Store]:
    """A store on a fresh PostgreSQL database, reached through the proxy."""
    store = Store(proxy.url(postgres_url), retry_seconds=5.0)
    store.create_all()
    yield store
    store.close()


def _events(store: Store, key: str) -> list[tuple[str | None, str]]:
    return [(e.from_status, e.to_status) for e in store.events_for_call(key)]


def _tool_messages(store: Store, session_id: str) -> list[Any]:
    with store.read() as conn:
        return list(conn.execute(text(
            "SELECT key, call_status FROM dex_messages WHERE role = 'tool' AND session_id = :s"
            " ORDER BY id"), {"s": session_id}))


# -- the store across a reconnect ----------------------------------------------------------------


def test_a_write_whose_answer_was_lost_is_won_once(proxied: Store, proxy: TcpProxy) -> None:
    # Given a proxy that loses the answer to the next statement holding the call's key after
    # the server ran it: the insert, the claim and the terminal move are each one statement in
    # autocommit, so each has committed when its client's connection dies
    ended: list[EndedCall] = []
    proxied.on_calls_ended(ended.extend)
    proxy.lose_reply("s/t/c")
    assert proxied.insert_call(call_row("s/t/c"))
    assert proxy.stats()["statements-lost"] == 1

    # When the call is claimed and finished, each statement's answer lost again
    proxy.lose_reply("s/t/c")
    claimed = proxied.claim("s/t/c", "w@h:1", 30.0, lambda row: "vetted")
    proxy.lose_reply("s/t/c")
    finished = proxied.transition("s/t/c", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                                  match={"worker": "w@h:1"}, values={"result": "42"})

    # Then each retry recognised its own committed change as won and wrote nothing twice
    assert proxy.stats()["statements-lost"] == 3
    assert claimed is not None and claimed[1] == "vetted" and claimed[0].attempts == 1
    assert finished is True
    row = proxied.get_call("s/t/c")
    assert row is not None and (row.status, row.result, row.attempts) == ("succeeded", "42", 1)
    assert _events(proxied, "s/t/c") == [(None, "queued"), ("queued", "running"),
                                         ("running", "succeeded")]
    assert [m.call_status for m in _tool_messages(proxied, "s")] == ["succeeded"]
    # And the call's end was announced once (waiters woken, metrics counted), though the try
    # that committed it lost its connection before its own announcement
    assert [(e.key, e.status) for e in ended] == [("s/t/c", CallStatus.SUCCEEDED)]


def test_a_commit_whose_answer_was_lost_is_won_once(proxied: Store, proxy: TcpProxy) -> None:
    # Given a batch of calls (one transaction) whose COMMIT's answer is lost after the server
    # committed it: the client's connection dies during COMMIT
    proxy.lose_commit_reply()
    assert proxied.insert_calls([call_row("s/t/c1"), call_row("s/t/c2")])
    assert proxy.stats()["commits-lost"] == 1
    # Then the retry recognised its own batch, written once
    assert [_events(proxied, k) for k in ("s/t/c1", "s/t/c2")] == [[(None, "queued")]] * 2


def test_a_commit_whose_answer_was_lost_is_not_taken_for_someone_elses(
    proxied: Store, proxy: TcpProxy
) -> None:
    # Given a running call that another worker finishes first
    assert proxied.insert_call(call_row("s/t/c"))
    assert proxied.claim("s/t/c", "w@h:1", 30.0, lambda row: None) is not None
    assert proxied.transition("s/t/c", CallStatus.FAILED, match={"worker": "w@h:1"},
                              values={"error": "first"})
    # When our transition's answer is lost (it matched nothing, so it changed nothing)
    proxy.lose_reply("s/t/c")
    won = proxied.transition("s/t/c", CallStatus.SUCCEEDED, match={"worker": "w@h:1"},
                             values={"result": '"late"'})
    # Then the retry does not mistake the other writer's change for its own
    assert won is False
    assert proxied.get_call("s/t/c").error == "first"  # type: ignore[union-attr]
    assert len(_events(proxied, "s/t/c")) == 3


def test_a_write_lost_before_the_server_saw_it_is_run_again(
    proxied: Store, proxy: TcpProxy
) -> None:
    assert proxied.insert_call(call_row("s/t/c"))
    # When the connection dies with the claim unsent (the server never ran it)
    proxy.lose_statement("s/t/c")
    claimed = proxied.claim("s/t/c", "w@h:1", 30.0, lambda row: row.attempts)
    # Then the claim ran again on a new connection, once
    assert claimed is not None and claimed[1] == 1
    assert proxy.stats()["statements-lost"] == 1
    assert _events(proxied, "s/t/c") == [(None, "queued"), ("queued", "running")]


def test_set_based_transitions_and_renewals_survive_lost_connections(
    proxied: Store, proxy: TcpProxy
) -> None:
    keys = [f"s/t/c{i}" for i in range(4)]
    for key in keys:
        assert proxied.insert_call(call_row(key))
        assert proxied.claim(key, "w@h:1", 30.0, lambda row: None) is not None
    # A renewal whose connection was cut just before
    assert proxy.reset() >= 1
    assert proxied.renew_leases("w@h:", keys, 60.0) == 4
    # A set-based move whose COMMIT answer is lost, guarded per call (c3 is another owner's)
    ended: list[EndedCall] = []
    proxied.on_calls_ended(ended.extend)
    proxy.lose_commit_reply()
    moved = proxied.transition_many(
        [Move(k, CallStatus.FAILED, match={"worker": "w@h:1" if k != keys[3] else "w@h:2"},
              values={"error": f"lost {k}"}) for k in keys],
        allowed={CallStatus.RUNNING})
    assert moved == set(keys[:3])
    for key in keys[:3]:
        assert proxied.get_call(key).error == f"lost {key}"  # type: ignore[union-attr]
        assert _events(proxied, key)[-1] == ("running", "failed")
        assert len(_events(proxied, key)) == 3
    assert proxied.get_call(keys[3]).status == "running"  # type: ignore[union-attr]
    # and the calls it ended were announced once each
    assert sorted(e.key for e in ended) == keys[:3]
    assert {e.status for e in ended} == {CallStatus.FAILED}


def test_a_transition_waits_out_a_cut_and_gives_up_after_its_budget(
    proxied: Store, proxy: TcpProxy, postgres_url: str
) -> None:
    assert proxied.insert_call(call_row("s/t/c"))
    # Given the store cut for 1.5 s just now (every connection closed, new ones refused)
    proxy.cut(1.5)
    started = time.monotonic()
    # When a transition runs during the cut, it lands once the store is back
    assert proxied.claim("s/t/c", "w@h:1", 30.0, lambda row: None) is not None
    assert 1.0 < time.monotonic() - started < 5
    # And a cut longer than the retry budget ends in StoreUnavailableError, bounded
    impatient = Store(proxy.url(postgres_url), retry_seconds=1.0)
    proxy.cut(3.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        impatient.transition("s/t/c", CallStatus.SUCCEEDED, values={"result": "1"})
    assert time.monotonic() - started < 2.5
    impatient.close()
    assert proxied.get_call("s/t/c").status == "running"  # type: ignore[union-attr]


# -- real workers whose store goes away while their tools run ------------------------------------


@pytest.fixture
def settings(redis_url: str, postgres_url: str, proxy: TcpProxy) -> DexSettings:
    # Everything (workers, the client, the sweeper) reaches PostgreSQL through the proxy, so
    # a cut is the server restarting as every one of them sees it. A 3 s lease: shorter than
    # the cuts below, so every lease runs out while the store is away.
    return fast_settings(redis_url, proxy.url(postgres_url), lease_seconds=3.0)


def test_tools_that_finish_while_the_store_is_cut_end_succeeded_and_run_once(
    client: DexClient, start_worker: StartWorker, proxy: TcpProxy, ledger_path: Path,
    sweeping: list[int], postgres_url: str,
) -> None:
    # Given calls on every path whose tools take 3 s, and calls whose tools take 7 s
    worker = start_worker(concurrency=9)
    during = [*calls_on_every_path(client, "a", 3.0), *calls_on_every_path(client, "b", 3.0)]
    after = calls_on_every_path(client, "c", 7.0)
    for key in [*during, *after]:
        started_pid(ledger_path, key)

    # When the store goes away for 4 s (longer than a lease) while every tool is running: the
    # short ones finish during the cut, the long ones after it, their leases run out meanwhile
    closed = proxy.cut(4.0)
    cut_at = time.time()

    # Then every call ends succeeded, its tool run once, with one finishing event (read here
    # by an observer that is not behind the proxy)
    with DexClient(client.settings.model_copy(update={"database_url": postgres_url}),
                   create_tables=False) as observer:
        finals = {key: observer.wait(key, 60) for key in [*during, *after]}
        events = {key: [e.to_status for e in observer.store.events_for_call(key)]
                  for key in finals}
    assert closed > 0
    for key, final in finals.items():
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
        assert events[key] == ["queued", "running", "succeeded"]
        assert final.finished_at is not None
        # (finished_at is when the tool returned)
        if key in during:
            assert cut_at < final.finished_at.timestamp() < cut_at + 4
        else:
            assert final.finished_at.timestamp() > cut_at + 4
    assert ledger.executions(ledger_path) == {key: 1 for key in finals}
    # And the reaper, sweeping all along, took no live call (whether it met a lease that ran
    # out during the cut before or after its renewal landed depends on which retried first;
    # test_store_stalls.py makes the reaper meet one every time)
    assert sum(sweeping) == 0 and len(sweeping) > 10
    assert "store_retry" in worker.log()


def test_a_worker_whose_claim_or_ending_lost_its_answer_runs_the_tool_once(
    settings: DexSettings, start_worker: StartWorker, proxy: TcpProxy, ledger_path: Path,
    postgres_url: str,
) -> None:
    # Given a worker behind the proxy (the client reaches the server directly), and calls on
    # both paths, a read and a single-attempt charge
    worker = start_worker(concurrency=1)
    direct = settings.model_copy(update={"database_url": postgres_url})
    finals = {}
    with DexClient(direct) as client:
        for skip, what in ((0, "claim"), (1, "ending")):
            for tool, arguments in (("lookup_order", {"order_id": "1001"}),
                                    ("charge_card", {"customer_id": "cu_1",
                                                     "amount_cents": 5})):
                key = idempotency_key("s", "t", f"{what}-{tool}")
                # When the worker's claim (its first statement holding the key) or its ending
                # (the second) runs and commits, but the answer never reaches the worker
                lost = proxy.stats()["statements-lost"]
                proxy.lose_reply(key, skip=skip)
                client.call_tool(session_id="s", turn_id="t", tool_call_id=f"{what}-{tool}",
                                 tool=tool, arguments=arguments)
                finals[key] = client.wait(key, 30)
                assert proxy.stats()["statements-lost"] == lost + 1, (what, tool)
        events = {key: [e.to_status for e in client.store.events_for_call(key)]
                  for key in finals}
        tool_messages = [m.key for m in _tool_messages(client.store, "s")]
    # Then the retry recognised its own committed write: every call succeeded, its tool ran
    # once, one attempt, one event per move and one tool message each
    for key, final in finals.items():
        assert final.status is CallStatus.SUCCEEDED, final.error
        assert final.attempts == 1
        assert events[key] == ["queued", "running", "succeeded"]
    assert sorted(tool_messages) == sorted(finals)
    assert ledger.executions(ledger_path) == {key: 1 for key in finals}
    # Every write whose answer was lost was recognised, none written twice. The read's first
    # statement holding its key is a read (a retrying call stores no claim: DESIGN v4), which
    # is simply run again: one recovered write fewer than calls.
    assert worker.log().count("store_commit_recovered") == len(finals) - 1


def test_the_client_and_workers_recover_when_the_server_closes_idle_connections(
    client: DexClient, start_worker: StartWorker, ledger_path: Path, postgres_url: str,
) -> None:
    # Given a client and a worker that have used the store and now sit idle for a while
    start_worker(concurrency=1)
    first = client.call_tool(session_id="s", turn_id="t", tool_call_id="c1",
                             tool="lookup_order", arguments={"order_id": "1001"})
    assert client.wait(first.key, 30).status is CallStatus.SUCCEEDED
    idle_from = time.monotonic()
    wait_until(lambda: time.monotonic() > idle_from + 1.5, 10, "the client to idle")

    # When the server ends every session of the database (an idle timeout, an operator)
    admin = create_engine(postgres_url.rsplit("/", 1)[0] + "/postgres",
                          isolation_level="AUTOCOMMIT")
    database = postgres_url.rsplit("/", 1)[1]
    with admin.connect() as conn:
        ended = conn.execute(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": database}).scalar()
    admin.dispose()
    assert ended and ended >= 2

    # Then the client's next calls work, reads of a whole session included (its pooled
    # connections had idled, so they are tested before use), and the worker claims and
    # finishes a new call (its claim retried on a new connection)
    assert [c.key for c in client.get_agent_snapshot("s").tool_calls] == [first.key]
    assert client.get_tool_call(first.key).status is CallStatus.SUCCEEDED
    second = client.call_tool(session_id="s", turn_id="t", tool_call_id="c2",
                              tool="lookup_order", arguments={"order_id": "1002"})
    assert client.wait(second.key, 30).status is CallStatus.SUCCEEDED
    assert ledger.executions(ledger_path) == {first.key: 1, second.key: 1}
