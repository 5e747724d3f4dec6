"""A worker, beat and an agent behind PgBouncer in transaction mode, with the pooler settings
docs/deploying.md gives, and a cut between the pooler and the server (issue 30, item 1).

PgBouncer (Debian's 1.18, ``tests/pgbouncer.py``) reaches PostgreSQL through a TCP proxy of
our own (``tests/tcp_proxy.py``), which the test cuts: every server session the pooler holds
is closed and new ones are refused for a while, as when the server restarts or a partition
separates the pooler from it. The processes keep their connections to the pooler.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dex_tasks import CallStatus, DexClient
from tests.conftest import fast_settings, settings_env
from tests.helpers import (
    ROOT,
    TcpProxy,
    WorkerProcess,
    calls_on_every_path,
    start_process,
    started_pid,
)
from tests.pgbouncer import PgBouncer, require_pgbouncer
from workers import ledger


def documented_settings() -> dict[str, str]:
    """The ``[pgbouncer]`` settings of docs/deploying.md's "Behind a connection pooler"."""
    page = (ROOT / "docs" / "deploying.md").read_text()
    section = page.split("## Behind a connection pooler", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```ini\n(.*?)```", section, re.S)
    assert block is not None, "the pooler section has no ```ini block"
    values = {}
    for line in block[1].splitlines():
        line = line.strip()
        if line and not line.startswith((";", "#", "[")):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


@pytest.fixture
def server_link() -> Iterator[TcpProxy]:
    """The TCP proxy between the pooler and PostgreSQL."""
    proxy = TcpProxy("127.0.0.1:5432").start()
    yield proxy
    proxy.stop()


@pytest.fixture
def documented_pooler(server_link: TcpProxy) -> Iterator[PgBouncer]:
    """A PgBouncer with docs/deploying.md's settings, in front of ``server_link``."""
    require_pgbouncer()
    bouncer = PgBouncer(server=f"127.0.0.1:{server_link.port}",
                        settings=documented_settings()).start()
    yield bouncer
    bouncer.cleanup()


def test_the_documented_settings_are_a_transaction_pooler() -> None:
    settings = documented_settings()
    assert settings["pool_mode"] == "transaction"
    assert "options" not in settings.get("ignore_startup_parameters", "")


def test_a_worker_beat_and_an_agent_work_through_the_pooler_and_a_cut_behind_it(
        redis_url: str, postgres_url: str, documented_pooler: PgBouncer,
        server_link: TcpProxy, ledger_path: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a worker, beat and an agent, all told of the pooler and reaching the store only
    # through it
    monkeypatch.setenv("DEX_STORE_POOLER", "transaction")
    settings = fast_settings(redis_url, documented_pooler.url(postgres_url))
    assert settings.store_pooler == "transaction"
    env = settings_env(settings, ledger_path)
    worker = WorkerProcess(start_process(
        ["worker", "--tools", "workers.example_tools", "-c", "6"], env,
        tmp_path / "worker.log"), tmp_path / "worker.log")
    beat = start_process(["beat"], env, tmp_path / "beat.log")
    try:
        worker.wait_ready(60)
        with DexClient(settings) as client:
            # When calls run on every path (a read, an idempotent write, a single-attempt
            # charge), one waits for an approval that is given, one for a deadline beat sweeps
            first = calls_on_every_path(client, "first", 0.0)
            approved = client.call_tool(session_id="s", turn_id="t", tool_call_id="approved",
                                        tool="refund_payment",
                                        arguments={"charge_id": "ch_1", "amount_cents": 5})
            expiring = client.call_tool(session_id="s", turn_id="t", tool_call_id="expiring",
                                        tool="refund_payment",
                                        arguments={"charge_id": "ch_2", "amount_cents": 5},
                                        approval_deadline=1.0)
            assert approved.interrupt_id is not None
            assert client.resolve_interrupt("s", approved.interrupt_id, True,
                                            approver="ops@example.com")
            for key in [*first, approved.key]:
                assert client.wait(key, 60).status is CallStatus.SUCCEEDED
            swept = client.wait(expiring.key, 60)
            assert swept.status is CallStatus.REJECTED and "deadline" in (swept.error or "")

            # And then the pooler loses the server for 4 s while tools run: every server
            # session it held is closed, and new ones are refused until the link is back
            during = calls_on_every_path(client, "during", 3.0)
            for key in during:
                started_pid(ledger_path, key)
            closed = server_link.cut(4.0)
            cut_at = time.monotonic()
            finals = {key: client.wait(key, 90) for key in during}

            # Then every call ends succeeded, after the link came back, its tool run once
            assert closed > 0
            assert time.monotonic() - cut_at >= 3.0
            for key, final in finals.items():
                assert final.status is CallStatus.SUCCEEDED, (key, final.error)
                assert final.attempts == 1
            runs = ledger.executions(ledger_path)
            assert runs == {key: 1 for key in [*first, approved.key, *during]}, runs
            # And a call made after the cut runs as well, through the same pooler
            after = calls_on_every_path(client, "after", 0.0)
            assert all(client.wait(key, 60).status is CallStatus.SUCCEEDED for key in after)
        # And no process ever sent a startup option or lost a prepared statement
        for log in (worker.log(), (tmp_path / "beat.log").read_text()):
            assert "unsupported startup parameter" not in log
            assert "prepared statement" not in log
        assert beat.poll() is None and worker.proc.poll() is None
    finally:
        worker.discard()
        beat.kill()
        beat.wait(10)
