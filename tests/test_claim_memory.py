"""Redis holds the claims of calls in flight, not of a month's calls (issue 30 item 4).

A single-attempt call's claim (``dex:claim:<key>``) keeps its long TTL while the call is open;
the notifier that announces the call's end cuts it to ``claim_ended_ttl_seconds``. The store's
ended record is what refuses a second run: a late duplicate of an ended charge whose claim has
expired takes a fresh claim, is refused by the store, and leaves a claim as short-lived. Real
Redis, a real worker, the ledger counting every execution.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.broker.celery_app import publish
from dex_tasks.worker import claims
from tests.conftest import StartWorker, fast_settings
from tests.helpers import wait_until
from workers import example_tools, ledger

assert example_tools.charge_card.name == "charge_card"

ENDED_TTL = 1
CHARGES = 12


@pytest.fixture
def settings(redis_url: str, sqlite_url: str) -> DexSettings:
    return fast_settings(redis_url, sqlite_url, claim_ended_ttl_seconds=ENDED_TTL)


def _claims(r: redis.Redis) -> list[bytes]:
    return list(r.scan_iter(match=claims.PREFIX + "*", count=1000))


def test_ended_single_attempt_calls_leave_no_claim_behind(
    client: DexClient, start_worker: StartWorker, ledger_path: Path
) -> None:
    r = redis.Redis.from_url(client.settings.redis_url)
    # Given a worker, and charges and a read that run to their end
    worker = start_worker(concurrency=2)
    charges = [client.call_tool(session_id="mem", turn_id="t", tool_call_id=f"c{i}",
                                tool="charge_card",
                                arguments={"customer_id": "cu_1", "amount_cents": 100 + i})
               for i in range(CHARGES)]
    read = client.call_tool(session_id="mem", turn_id="t", tool_call_id="r",
                            tool="lookup_order", arguments={"order_id": "1001"})
    for record in [*charges, read]:
        assert client.wait(record.key, 30).status is CallStatus.SUCCEEDED

    # Then no ended charge's claim outlives the ended TTL (it was 30 days): at once, each is
    # either gone or has at most ENDED_TTL seconds left
    for record in charges:
        assert r.ttl(claims.claim_key(record.key)) <= ENDED_TTL
    # and soon Redis holds no claim at all
    wait_until(lambda: _claims(r) == [], ENDED_TTL + 10, "every ended claim to expire")

    # When a late duplicate of an ended charge arrives after its claim expired
    late = client.store.get_call(charges[0].key)
    assert late is not None
    publish(client.app, late)
    wait_until(lambda: f"key={late.key}" in worker.log()
               and "action=duplicate_delivery" in worker.log(), 20,
               "the late duplicate to be ignored")

    # Then the store refused it: the charge ran once, and is as it was
    assert client.store.get_call(late.key) == late
    assert ledger.executions(ledger_path) == {
        **{record.key: 1 for record in charges}, read.key: 1}
    # and the claim the duplicate took is as short-lived, so Redis is empty again
    assert r.ttl(claims.claim_key(late.key)) <= ENDED_TTL
    wait_until(lambda: _claims(r) == [], ENDED_TTL + 10, "the duplicate's claim to expire")
    r.close()
