"""Redis high availability and TLS, on real servers: a Sentinel failover under load, rediss://.

The failover test runs a master, a replica and three Sentinels, a ``dex-tasks worker`` and
``dex-tasks beat`` pointed at the Sentinels, and an agent submitting a few hundred calls (reads
and single-attempt charges) while the master is SIGKILLed. Redis replication is asynchronous,
so the promoted replica may lack the last queued messages and claims: the guarantees must come
from the store and the sweeps, and they are checked against the tools' own ledger.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dex_tasks import TOOL_DID_NOT_RUN, CallStatus, DexClient, DexSettings, ToolCallRecord
from dex_tasks.broker import routing
from dex_tasks.broker.celery_app import create_app
from dex_tasks.broker.metrics import SWEEP_STATS_KEY, metrics_redis, render_metrics
from dex_tasks.broker.redis_clients import redis_client
from dex_tasks.broker.transport import SentinelTransport, Transport
from dex_tasks.errors import ConfigurationError
from tests.conftest import fast_settings, settings_env
from tests.helpers import WorkerProcess, start_process, wait_until
from tests.redis_ha import (
    MASTER_NAME,
    Certificates,
    SentinelGroup,
    start_sentinel_group,
    start_tls_redis,
)
from workers import example_tools, ledger

assert example_tools.charge_card  # registered here too: call_tool validates locally

CALLS = 240
KILL_AFTER = 80
MIN_AFTER = 40
SETTLE_SECONDS = 2.0


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    group = start_sentinel_group()
    yield group
    group.stop()


def test_sentinel_failover_under_load_loses_nothing_and_runs_nothing_twice(
    sentinel_group: SentinelGroup, sqlite_url: str, ledger_path: Path, tmp_path: Path
) -> None:
    # Given a worker and beat that reach Redis only through the Sentinels
    settings = fast_settings(sentinel_group.url, sqlite_url,
                             redis_sentinel_master=MASTER_NAME)
    env = settings_env(settings, ledger_path)
    worker = WorkerProcess(start_process(["worker", "--tools", "workers.example_tools",
                                          "-c", "3"], env, tmp_path / "worker.log"),
                           tmp_path / "worker.log")
    beat = start_process(["beat"], env, tmp_path / "beat.log")
    client = DexClient(settings)
    try:
        worker.wait_ready()
        # The worker announced itself and its tools through the Sentinels (it used to fail
        # on the sentinel:// URL, so its tools looked unserved to the sweeps)
        announced = redis_client(settings)
        wait_until(lambda: "charge_card" in routing.live_tools(announced), 10,
                   "the worker's announcement")
        announced.close()
        old_master = sentinel_group.master_port()
        assert old_master == sentinel_group.master.port

        # When an agent submits reads and single-attempt charges, and a third of the way in
        # the master is SIGKILLed
        records: dict[str, ToolCallRecord] = {}
        submitted_at: dict[str, float] = {}
        promoted_at: list[float] = []

        def watch_failover() -> None:
            wait_until(lambda: sentinel_group.master_port() == sentinel_group.replica.port,
                       30, "a Sentinel majority to promote the replica", interval=0.1)
            promoted_at.append(time.monotonic())

        watcher = threading.Thread(target=watch_failover, daemon=True)
        def made_after_promotion() -> list[str]:
            # Calls made once the new master had a moment to be found (publishers retry)
            return [k for k, at in submitted_at.items()
                    if promoted_at and at > promoted_at[0] + SETTLE_SECONDS]

        i = 0
        while i < CALLS or len(made_after_promotion()) < MIN_AFTER:
            if i == KILL_AFTER:
                assert sentinel_group.master.proc is not None
                os.kill(sentinel_group.master.proc.pid, signal.SIGKILL)
                watcher.start()
            if i > KILL_AFTER and not watcher.is_alive():
                assert promoted_at, "the replica was never promoted"
            if i % 2:
                tool, arguments = "charge_card", {"customer_id": f"cu_{i}", "amount_cents": i}
            else:
                tool, arguments = "lookup_order", {"order_id": "1001"}
            record = client.call_tool(session_id="ha", turn_id="t", tool_call_id=f"c{i}",
                                      tool=tool, arguments=arguments)
            records[record.key] = record
            submitted_at[record.key] = time.monotonic()
            time.sleep(0.03)  # a steady agent, so calls arrive before, during and after
            i += 1
        watcher.join(35)
        assert promoted_at, "the replica was never promoted"

        # Then every call ends terminal (lost messages are republished by beat's sweeps)
        def all_terminal() -> bool:
            return all(client.get_tool_call(k).terminal for k in records)

        wait_until(all_terminal, 60, "every call to end", interval=0.2)
        final = {k: client.get_tool_call(k) for k in records}
        # The same worker and beat processes rode through the failover, and the sweeps they
        # run record their statistics on the new master, where a metrics scrape finds them
        assert worker.proc.poll() is None, worker.log()[-3000:]
        assert beat.poll() is None, (tmp_path / "beat.log").read_text()[-3000:]
        stats = redis_client(settings)
        assert stats.info("replication")["role"] == "master"
        assert stats.connection_pool.get_master_address()[1] == sentinel_group.replica.port
        promoted_wall = time.time() - (time.monotonic() - promoted_at[0])

        def swept_since_promotion() -> bool:
            last = stats.hget(SWEEP_STATS_KEY, "republish_stranded:last_run")
            return last is not None and float(last) > promoted_wall

        wait_until(swept_since_promotion, 20, "a sweep to run against the new master")
        scrape = render_metrics(client.store, metrics_redis(settings))[0].decode()
        assert "dex_redis_up 1.0" in scrape and "dex_sweep_runs_total{" in scrape
        stats.close()
    finally:
        client.close()
        worker.discard()
        beat.kill()
        beat.wait(10)

    runs = ledger.executions(ledger_path)
    statuses = Counter(r.status.value for r in final.values())
    charges = [k for k, r in final.items() if r.tool == "charge_card"]

    # No single-attempt call ran twice; no read ran more often than its attempts
    assert all(runs[k] <= 1 for k in charges), {k: runs[k] for k in charges if runs[k] > 1}
    assert all(runs[k] <= r.attempts for k, r in final.items() if r.tool == "lookup_order")
    # Every outcome is honest: a call that "did not run" never reached the tool, and a call
    # that succeeded ran (a single-attempt one exactly once)
    for key, record in final.items():
        if record.status is CallStatus.FAILED:
            assert record.error is not None and record.error.startswith(TOOL_DID_NOT_RUN), record
            assert runs[key] == 0, record
        elif record.status is CallStatus.SUCCEEDED:
            assert runs[key] == (1 if record.tool == "charge_card" else record.attempts)
        else:
            assert record.status is CallStatus.OUTCOME_UNKNOWN and record.tool == "charge_card"
    # And calls go on: everything submitted once the replica was promoted succeeded
    after = made_after_promotion()
    assert len(after) >= MIN_AFTER
    assert all(final[k].status is CallStatus.SUCCEEDED for k in after), [
        (k, final[k].status.value, final[k].error) for k in after
        if final[k].status is not CallStatus.SUCCEEDED]
    print(f"\nfailover: {dict(statuses)}, {len(after)} calls after promotion")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Certificates, int]]:
    """A Redis that speaks only TLS and wants a client certificate from the test CA."""
    certs = Certificates(tmp_path_factory.mktemp("certs"))
    server = start_tls_redis(certs)
    yield certs, server.port
    server.cleanup()


def _tls_settings(tls_redis: tuple[Certificates, int], sqlite_url: str) -> DexSettings:
    """Settings for the TLS Redis: rediss://, our CA, a client certificate."""
    certs, port = tls_redis
    return fast_settings(f"rediss://127.0.0.1:{port}/0", sqlite_url,
                         redis_tls_ca_file=str(certs.ca),
                         redis_tls_cert_file=str(certs.client_cert),
                         redis_tls_key_file=str(certs.client_key))


def test_tls_redis_for_the_broker_and_the_claims(
    tls_redis: tuple[Certificates, int], sqlite_url: str, ledger_path: Path, tmp_path: Path
) -> None:
    # Given a worker and an agent configured for it: rediss://, our CA, a client certificate
    settings = _tls_settings(tls_redis, sqlite_url)
    env = settings_env(settings, ledger_path)
    worker = WorkerProcess(start_process(["worker", "--tools", "workers.example_tools",
                                          "-c", "1"], env, tmp_path / "worker.log"),
                           tmp_path / "worker.log")
    client = DexClient(settings)
    try:
        worker.wait_ready()
        # When the agent calls a read and a single-attempt charge
        read = client.call_tool(session_id="tls", turn_id="t", tool_call_id="read",
                                tool="lookup_order", arguments={"order_id": "1001"})
        charge = client.call_tool(session_id="tls", turn_id="t", tool_call_id="charge",
                                  tool="charge_card",
                                  arguments={"customer_id": "cu_1", "amount_cents": 100})
        # Then both run once, and the charge's claim is in the TLS Redis
        assert client.wait(read.key, 20).status is CallStatus.SUCCEEDED
        assert client.wait(charge.key, 20).status is CallStatus.SUCCEEDED
        claims = redis_client(settings)
        assert claims.exists(f"dex:claim:{charge.key}") == 1
        claims.close()
    finally:
        client.close()
        worker.discard()
    assert ledger.executions(ledger_path) == {read.key: 1, charge.key: 1}


def test_a_waiter_over_tls_is_woken_by_the_announcement_not_by_a_poll(
    tls_redis: tuple[Certificates, int], sqlite_url: str
) -> None:
    from dex_tasks.broker.ended import ended_channel
    from dex_tasks.broker.notify import CallWatcher
    from dex_tasks.broker.redis_clients import connector

    # Given a watcher on a TLS Redis (its thread waits on the TLS socket and its own pipe)
    settings = _tls_settings(tls_redis, sqlite_url)
    watcher = CallWatcher(connector(settings))
    publisher = redis_client(settings)
    try:
        with watcher.watch("tls/first") as first:
            assert first.wait(15), "the subscription over TLS was not confirmed"
        for i in range(3):
            with watcher.watch(f"tls/call/{i}") as watch:
                assert watch.wait(15), "a later subscription over TLS was not confirmed"
                # When its call's end is announced, with a record of several TLS records' size
                message = "succeeded " + "x" * 40_000
                assert publisher.publish(ended_channel(f"tls/call/{i}"), message) == 1
                # Then the watch hears all of it
                assert watch.wait(15), "the announcement over TLS did not wake the waiter"
                assert watch.message == message.encode()
    finally:
        watcher.close()
        publisher.close()


def test_a_redis_whose_certificate_is_not_trusted_is_refused(
    tls_redis: tuple[Certificates, int], sqlite_url: str
) -> None:
    # Given an agent that does not trust the test CA (the system's CAs only). Database 1:
    # kombu shares producer pools between apps whose URL and transport options are equal,
    # whatever their TLS options, so database 0 would reuse the previous test's connection.
    certs, port = tls_redis
    settings = fast_settings(f"rediss://127.0.0.1:{port}/1", sqlite_url,
                             redis_tls_cert_file=str(certs.client_cert),
                             redis_tls_key_file=str(certs.client_key))

    # When it reaches Redis for a claim, or through Celery's broker to publish a call
    claims = redis_client(settings)
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        claims.ping()
    claims.close()
    with DexClient(settings) as client:
        record = client.call_tool(session_id="tls", turn_id="t", tool_call_id="c",
                                  tool="lookup_order", arguments={"order_id": "1001"})

    # Then both refuse the server (kombu alone would have connected without verifying), and
    # the call tells the model it did not run
    assert record.status is CallStatus.FAILED
    assert record.error is not None and record.error.startswith(TOOL_DID_NOT_RUN)
    assert "certificate verify failed" in record.error.lower()


@pytest.mark.parametrize(("values", "names"), [
    ({"redis_url": "sentinel://127.0.0.1:26379/0"}, "DEX_REDIS_SENTINEL_MASTER"),
    ({"redis_url": "redis://127.0.0.1/0", "redis_sentinel_master": "m"},
     "DEX_REDIS_SENTINEL_MASTER"),
    ({"redis_url": "http://127.0.0.1/0"}, "DEX_REDIS_URL"),
    ({"redis_url": "sentinel://127.0.0.1:26379/x", "redis_sentinel_master": "m"},
     "DEX_REDIS_URL"),
    ({"redis_url": "redis://127.0.0.1/0", "redis_tls_ca_file": "/ca.pem"},
     "DEX_REDIS_TLS_CA_FILE"),
    ({"redis_url": "rediss://127.0.0.1/0", "redis_tls_cert_file": "/c.pem"},
     "DEX_REDIS_TLS_KEY_FILE"),
])
def test_a_redis_setting_that_cannot_work_is_refused_naming_it(
    values: dict[str, str], names: str
) -> None:
    settings = DexSettings(**values)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=names):
        redis_client(settings)
    with pytest.raises(ConfigurationError, match=names):
        create_app(settings)


def test_a_sentinel_url_keeps_its_password_out_of_the_error() -> None:
    settings = DexSettings(redis_url="sentinel://:s3cret-pw@127.0.0.1:26379/zero",
                           redis_sentinel_master="m")
    with pytest.raises(ConfigurationError) as err:
        redis_client(settings)
    assert "s3cret-pw" not in str(err.value)


@pytest.mark.parametrize("publisher", [False, True])
def test_every_app_reuses_one_redis_client_per_broker_channel(
    settings: DexSettings, publisher: bool
) -> None:
    # Given the app a worker is built on (publisher=False) and the one DexClient publishes with
    app = create_app(settings, publisher=publisher)
    try:
        # When its broker channel sends synchronous commands (a publish; in a worker's main
        # process, each message's unacked-set write and its ack)
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
                assert first.ping()

        # Then they share one client object: kombu's own channel builds a new redis.Redis per
        # command, about 50 µs of CPU each (a tenth of a worker main process's time per call)
        assert first is second
        assert isinstance(conn.transport, Transport)
    finally:
        app.close()


def test_a_sentinel_broker_uses_the_one_client_transport_too() -> None:
    settings = DexSettings(redis_url="sentinel://127.0.0.1:26379/0", redis_sentinel_master="m")
    app = create_app(settings)
    try:
        # Built without connecting: the Sentinels are only asked on the first command.
        assert isinstance(app.connection_for_write().transport, SentinelTransport)
    finally:
        app.close()
