"""Issue 28, suspected: "on PostgreSQL a claim that commits and is then refused (expired, no
attempt left) is moved back afterwards", so a worker killed in between would leave a
``running`` call no tool touched and a ``tool_call_started`` event for a tool that never
started.

Refuted, on both stores: the claim's own statement refuses such a call (its WHERE holds the
expiry and the attempts, ``store.moves.CLAIMABLE``). Nothing is committed as running, the
checks that need the row never run, and at the moment the claim returns, the moment a worker
killed in between would leave behind, the call is still queued and untouched, with no started
event. The worker's delivery then ends it "did not run" (or as its attempts ran out) from
``queued``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from dex_tasks import DexClient
from dex_tasks.states import CallStatus
from dex_tasks.store import Store
from dex_tasks.worker.claiming import claim
from dex_tasks.worker.execution import Runtime
from tests.conftest import fast_settings
from tests.test_store import call_row


@pytest.fixture
def runtime(redis_url: str, database_url: str) -> Iterator[Runtime]:
    with DexClient(fast_settings(redis_url, database_url)) as client:
        rt = Runtime(settings=client.settings, store=client.store,
                     redis=redis.Redis.from_url(redis_url), app=client.app)
        yield rt
        rt.redis.close()


def _refused_calls(store: Store) -> dict[str, dict[str, Any]]:
    past = time.time() - 60
    rows = {
        # expired in the queue (a queue deadline that passed before any worker took it)
        "s/t/expired": call_row("s/t/expired", expires_at=past),
        # retrying, every attempt used by lost workers, delivered once more
        "s/t/exhausted": call_row("s/t/exhausted", effect="read", tool="lookup_order",
                                  arguments='{"order_id":"o1"}', max_attempts=2, attempts=2),
    }
    for row in rows.values():
        assert store.insert_call(row)
    return rows


def test_a_claim_refused_for_expiry_or_attempts_commits_nothing_as_running(
    runtime: Runtime,
) -> None:
    store = runtime.store
    rows = _refused_calls(store)
    vetted: list[str] = []
    for key, row in rows.items():
        # When a delivery claims the call
        claimed = store.claim(key, "w@h:1", 30.0, lambda r: vetted.append(r.key))
        # Then nothing was claimed, and the checks that need a claimed row never ran
        assert claimed is None
        # And at this moment, where a worker killed now leaves the call, it is queued and
        # untouched: no owner, no lease, no attempt counted, no started event
        call = store.get_call(key)
        assert call is not None
        assert (call.status, call.attempts, call.worker, call.lease_expires_at) == (
            "queued", row["attempts"], None, None)
        assert [e.to_status for e in store.events_for_call(key)] == ["queued"]
    assert vetted == []


def test_the_worker_ends_a_refused_call_from_queued_without_a_started_event(
    runtime: Runtime,
) -> None:
    store = runtime.store
    _refused_calls(store)
    # When the worker's delivery claims each one
    expired = claim(runtime, "s/t/expired", "w@h:1")
    exhausted = claim(runtime, "s/t/exhausted", "w@h:1")
    # Then the expired call did not run, and the exhausted one failed, each straight from
    # queued: never running, so never outcome_unknown, and no tool_call_started event
    assert getattr(expired, "status", None) == CallStatus.FAILED
    assert getattr(exhausted, "status", None) == CallStatus.FAILED
    for key in ("s/t/expired", "s/t/exhausted"):
        events = store.events_for_call(key)
        assert [(e.from_status, e.to_status) for e in events] == [
            (None, "queued"), ("queued", "failed")], key
        assert all(e.to_status != CallStatus.RUNNING.value for e in events)
    call = store.get_call("s/t/expired")
    assert call is not None and call.attempts == 0
    assert "expired in the queue" in (call.error or ""), call.error
