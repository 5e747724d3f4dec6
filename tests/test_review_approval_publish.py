"""Issue 19, finding 16: a call approved while Redis is down runs as soon as Redis answers.

The approval returned True and the publish failed; the call stayed ``queued`` with the
approval's ``published_at``, so the republisher left it alone for a whole window (5 minutes by
default) after Redis was back. Here the window is two minutes: the call must run within
seconds of the heal.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

import workers.example_tools  # noqa: F401 - registers refund_payment (needs approval) here
from dex_tasks import CallStatus, DexClient, DexSettings
from tests.conftest import StartWorker, fast_settings
from tests.helpers import TcpProxy
from workers import ledger

WINDOW = 120.0


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    return fast_settings(redis_url, sqlite_url, republish_after_seconds=WINDOW)


@pytest.fixture
def redis_proxy(redis_url: str) -> Iterator[TcpProxy]:
    url = make_url(redis_url.replace("redis://", "postgresql://", 1))
    proxy = TcpProxy(f"{url.host}:{url.port}").start()
    yield proxy
    proxy.stop()


def test_a_call_approved_while_redis_is_down_runs_once_redis_answers(
    client: DexClient, settings: DexSettings, start_worker: StartWorker,
    beat: subprocess.Popen[bytes], redis_proxy: TcpProxy, redis_url: str, ledger_path: Path,
) -> None:
    # Given a refund waiting for approval, and an approver whose Redis goes through a proxy
    start_worker(concurrency=1)
    record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 500})
    assert record.status is CallStatus.AWAITING_APPROVAL and record.interrupt_id
    database = redis_url.rsplit("/", 1)[1]
    proxied = settings.model_copy(update={
        "redis_url": f"redis://127.0.0.1:{redis_proxy.port}/{database}"})
    with DexClient(proxied) as approver:
        # When it is approved while that Redis cannot be reached
        redis_proxy.cut(3)
        assert approver.resolve_interrupt("s", record.interrupt_id, True, approver="alice")
        assert client.get_tool_call(record.key).status is CallStatus.QUEUED
    healed = time.monotonic() + 3

    # Then it runs once, within seconds of Redis answering again, not a window later
    final = client.wait(record.key, timeout=20)
    assert final.status is CallStatus.SUCCEEDED
    assert time.monotonic() - healed < 15
    assert ledger.executions(ledger_path)[record.key] == 1
