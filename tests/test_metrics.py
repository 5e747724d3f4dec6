"""Prometheus metrics: counters kept in Redis as calls end, gauges of the open calls only
(SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from typing import Any

import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import text

import workers.example_tools  # noqa: F401 - registers the example tools in this process
from bench.sweep_scale import bulk_insert
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.broker.announce import install
from dex_tasks.broker.metrics import open_calls_query, render_metrics
from dex_tasks.store import CALLS, Store
from dex_tasks.tokens import issue_token
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import run_job
from tests.conftest import StartWorker
from tests.helpers import free_port

NOW = 1_800_000_000.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(body: bytes) -> Samples:
    """Every sample of a scrape, keyed by (name, labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def add_call(store: Store, key: str, tool: str, effect: str, *, created: float,
             end: CallStatus | None = None, finished: float | None = None,
             deadline: float | None = None) -> None:
    """A call inserted ``created`` and, if ``end`` is given, finished at ``finished``."""
    session, turn, call_id = key.split("/")
    awaiting = deadline is not None
    row: dict[str, Any] = {
        "key": key, "session_id": session, "turn_id": turn, "tool_call_id": call_id,
        "tool": tool, "arguments": "{}", "effect": effect, "requires_approval": awaiting,
        "max_attempts": 3, "status": (CallStatus.AWAITING_APPROVAL if awaiting
                                      else CallStatus.QUEUED).value,
        "attempts": 0, "interrupt_id": f"i-{key}" if awaiting else None,
        "created_at": created, "updated_at": created,
    }
    interrupt = {"interrupt_id": f"i-{key}", "key": key, "session_id": session,
                 "deadline_at": deadline, "created_at": created} if awaiting else None
    assert store.insert_call(row, interrupt)
    if end is None:
        return
    assert finished is not None
    if end is not CallStatus.FAILED:
        assert store.transition(key, CallStatus.RUNNING, now=created)
    assert store.transition(key, end, now=finished)


def test_ended_calls_are_counted_and_open_calls_gauged(database_url: str,
                                                       redis_url: str) -> None:
    store = Store(database_url)
    store.create_all()
    # The store a worker or client builds: every call it ends is counted in Redis.
    install(store, redis_url)
    counters = redis.Redis.from_url(redis_url)
    try:
        # Given reads that took 20 ms, 300 ms, 4 s and an hour, a failed write, a running
        # charge, and two refunds awaiting approval (one past its deadline)
        for i, took in enumerate((0.02, 0.3, 4.0, 3600.0)):
            add_call(store, f"s/t{i}/c", "lookup_order", "read", created=NOW - 4000,
                     end=CallStatus.SUCCEEDED, finished=NOW - 4000 + took)
        add_call(store, "s/w/c", "update_address", "idempotent_write", created=NOW - 5,
                 end=CallStatus.FAILED, finished=NOW - 4)
        add_call(store, "s/run/c", "charge_card", "non_idempotent_write", created=NOW - 1)
        assert store.transition("s/run/c", CallStatus.RUNNING, now=NOW - 1)
        add_call(store, "s/r1/c", "refund_payment", "non_idempotent_write", created=NOW - 60,
                 deadline=NOW + 60)
        add_call(store, "s/r2/c", "refund_payment", "non_idempotent_write", created=NOW - 60,
                 deadline=NOW - 1)

        # When Prometheus scrapes
        body, content_type = render_metrics(store, counters, now=NOW)
    finally:
        counters.close()
        store.close()

    # Then the ended calls are counted by tool, effect class and status
    assert content_type.startswith("text/plain")
    m = scrape(body)
    assert sample(m, "dex_store_up") == 1 and sample(m, "dex_redis_up") == 1
    read_ok = {"tool": "lookup_order", "effect": "read", "status": "succeeded"}
    assert sample(m, "dex_tool_calls_ended_total", **read_ok) == 4
    assert sample(m, "dex_tool_calls_ended_total", tool="update_address",
                  effect="idempotent_write", status="failed") == 1
    # And their latencies fill a cumulative histogram
    bucket = "dex_tool_call_duration_seconds_bucket"
    assert sample(m, bucket, le="0.01", **read_ok) == 0
    assert sample(m, bucket, le="0.025", **read_ok) == 1
    assert sample(m, bucket, le="0.5", **read_ok) == 2
    assert sample(m, bucket, le="2.5", **read_ok) == 2
    assert sample(m, bucket, le="5.0", **read_ok) == 3
    assert sample(m, bucket, le="3600.0", **read_ok) == 4
    assert sample(m, bucket, le="+Inf", **read_ok) == 4
    assert sample(m, "dex_tool_call_duration_seconds_count", **read_ok) == 4
    total = sample(m, "dex_tool_call_duration_seconds_sum", **read_ok) or 0
    assert abs(total - 3604.32) < 1e-6
    # And the open calls are gauged from the store, ended ones not at all
    assert sample(m, "dex_tool_calls_open", tool="charge_card", effect="non_idempotent_write",
                  status="running") == 1
    assert sample(m, "dex_tool_calls_open", tool="refund_payment",
                  effect="non_idempotent_write", status="awaiting_approval") == 2
    assert not [k for k in m if k[0] == "dex_tool_calls_open"
                and ("status", "succeeded") in k[1]]
    assert sample(m, "dex_pending_approvals", tool="refund_payment") == 2
    assert sample(m, "dex_overdue_approvals") == 1


def test_scrape_reads_only_the_open_calls(database_url: str) -> None:
    # Given 100k ended calls, loaded in bulk, and three open ones
    store = Store(database_url)
    store.create_all()
    try:
        ended = bulk_insert(store, CALLS, (
            {"key": f"old{i // 10}/t/c{i}", "session_id": f"old{i // 10}", "turn_id": "t",
             "tool_call_id": f"c{i}", "tool": f"tool{i % 7}", "arguments": "{}",
             "effect": "read", "requires_approval": False, "max_attempts": 3,
             "status": ("succeeded", "failed", "rejected", "outcome_unknown")[i % 4],
             "attempts": 1, "created_at": NOW - 100, "updated_at": NOW - 50,
             "finished_at": NOW - 50} for i in range(100_000)))
        assert ended == 100_000
        for i, status in enumerate(("queued", "running", "queued")):
            add_call(store, f"s/open{i}/c", "lookup_order", "read", created=NOW)
            if status == "running":
                assert store.transition(f"s/open{i}/c", CallStatus.RUNNING, now=NOW)
        with store.write() as conn:
            if not store.is_sqlite:
                conn.execute(text(f"ANALYZE {CALLS.name}"))
            plan = _plan(conn, open_calls_query())
        # When Prometheus scrapes
        m = scrape(render_metrics(store, now=NOW)[0])
    finally:
        store.close()
    # Then the open calls are counted from the (status, tool, effect) index, reading only
    # the open statuses' entries: no scan of the table, whatever the number of ended calls
    assert "ix_dex_calls_status_tool_effect" in plan, plan
    if database_url.startswith("sqlite"):
        assert "COVERING INDEX" in plan, plan
    assert "SCAN dex_tool_calls" not in plan and "Seq Scan" not in plan, plan
    assert sample(m, "dex_tool_calls_open", tool="lookup_order", effect="read",
                  status="queued") == 2
    assert sample(m, "dex_tool_calls_open", tool="lookup_order", effect="read",
                  status="running") == 1
    assert len([k for k in m if k[0] == "dex_tool_calls_open"]) == 2


def _plan(conn: Any, query: Any) -> str:
    sql = str(query.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
    if conn.dialect.name == "sqlite":
        return "\n".join(str(row[-1]) for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
    return "\n".join(str(row[0]) for row in conn.exec_driver_sql(f"EXPLAIN {sql}"))


def test_sweep_results_are_counted_across_processes(client: DexClient, rt: Runtime) -> None:
    # Given a refund whose approval deadline has passed
    record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_1", "amount_cents": 100},
                              approval_deadline=0.01)
    # When the deadline sweep runs twice (it would be two beats, or beat and an operator)
    later = time.time() + 5
    assert run_job(rt, "expire_approvals", now=later) == 1
    assert run_job(rt, "expire_approvals", now=later) == 0
    assert client.get_tool_call(record.key).status is CallStatus.REJECTED

    # Then a scrape from any process sees both runs and the one call they moved
    m = scrape(render_metrics(client.store, rt.redis)[0])
    assert sample(m, "dex_redis_up") == 1
    assert sample(m, "dex_sweep_runs_total", sweep="expire_approvals") == 2
    assert sample(m, "dex_sweep_moved_total", sweep="expire_approvals") == 1
    last = sample(m, "dex_sweep_last_run_timestamp_seconds", sweep="expire_approvals")
    assert last is not None and abs(last - time.time()) < 60


def test_unreachable_store_and_redis_are_reported_not_raised(tmp_path: Any) -> None:
    store = Store(f"sqlite:///{tmp_path / 'missing-dir' / 'dex.db'}")
    dead_redis = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    try:
        m = scrape(render_metrics(store, dead_redis)[0])
    finally:
        dead_redis.close()
    assert sample(m, "dex_store_up") == 0
    assert sample(m, "dex_redis_up") == 0
    assert not any(name == "dex_tool_calls" for name, _ in m)


def test_api_serves_metrics_only_with_the_metrics_token(settings: DexSettings,
                                                       client: DexClient) -> None:
    client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1", tool="refund_payment",
                     arguments={"charge_id": "ch_1", "amount_cents": 100})
    scraper = "metrics-token-for-prometheus"
    session_token = issue_token("test-secret-key", "s1", 60)

    # Given an API with no metrics token configured: /metrics is closed, and says what to set
    with TestClient(create_api(settings)) as http:
        closed = http.get("/metrics", headers={"Authorization": f"Bearer {scraper}"})
    assert closed.status_code == 401
    assert "DEX_METRICS_TOKEN" in closed.json()["detail"]

    # Given one with DEX_METRICS_TOKEN: no token, a wrong one, or a session's token get 401
    guarded = settings.model_copy(update={"metrics_token": SecretStr(scraper)})
    with TestClient(create_api(guarded)) as http:
        for headers in ({}, {"Authorization": "Bearer not-it"},
                        {"Authorization": f"Bearer {session_token}"}):
            refused = http.get("/metrics", headers=headers)
            assert refused.status_code == 401, headers
            assert "dex_tool_calls" not in refused.text
        response = http.get("/metrics", headers={"Authorization": f"Bearer {scraper}"})

    # Then the scraper's token gets the metrics
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    m = scrape(response.content)
    assert sample(m, "dex_store_up") == 1
    assert sample(m, "dex_redis_up") == 1
    assert sample(m, "dex_pending_approvals", tool="refund_payment") == 1


def test_api_counts_what_workers_end(settings: DexSettings, client: DexClient,
                                     start_worker: StartWorker) -> None:
    # Given a worker that ends a read and a broken report, and a refund awaiting approval
    start_worker(concurrency=2)
    ok = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                          tool="lookup_order", arguments={"order_id": "1001"})
    broken = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c2",
                              tool="broken_report", arguments={"report": "nope"})
    assert client.wait(ok.key, 20).status is CallStatus.SUCCEEDED
    assert client.wait(broken.key, 20).status is CallStatus.FAILED
    client.call_tool(session_id="s1", turn_id="t2", tool_call_id="c1", tool="refund_payment",
                     arguments={"charge_id": "ch_1", "amount_cents": 100})
    # When the API (another process's store) is scraped
    scraper = "metrics-token-for-prometheus"
    guarded = settings.model_copy(update={"metrics_token": SecretStr(scraper)})
    with TestClient(create_api(guarded)) as http:
        response = http.get("/metrics", headers={"Authorization": f"Bearer {scraper}"})
    # Then it counts what the worker ended, and gauges what is open
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    m = scrape(response.content)
    assert sample(m, "dex_store_up") == 1
    assert sample(m, "dex_redis_up") == 1
    assert sample(m, "dex_tool_calls_ended_total", tool="lookup_order", effect="read",
                  status="succeeded") == 1
    assert sample(m, "dex_tool_calls_ended_total", tool="broken_report", effect="read",
                  status="failed") == 1
    assert sample(m, "dex_pending_approvals", tool="refund_payment") == 1
