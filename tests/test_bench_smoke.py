"""The benchmarks of ``bench/`` run and produce figures, at tiny sizes.

Only that the harness works is checked here (every variant measured, every call succeeded,
results written, targets evaluated); nothing is asserted about time or speed.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import select

from bench.batch import run_batch
from bench.child import ENDING_PARTS, PIECES, run_child
from bench.driver import run_driver
from bench.held import OPERATIONS, VARIANTS, run_held
from bench.infra import child_env
from bench.io_bound import run_io, threads_pool_supported
from bench.latency import run_latency
from bench.many_tools import run_many_tools
from bench.memory import run_memory
from bench.overlap import VARIANTS as OVERLAP_VARIANTS
from bench.overlap import run_overlap
from bench.producer import PARTS, UNTIMED, WAIT_PIECES, run_producer
from bench.producer import PIECES as PRODUCER_PIECES
from bench.profile import run_profile
from bench.scrape import run_scrape
from bench.sweep_scale import DEFAULT_JOBS, run_sweeps
from bench.throughput import run_throughput
from tests.conftest import POSTGRES_URL
from tests.helpers import ROOT


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def _written(payload: dict[str, Any], out: Path) -> dict[str, Any]:
    path = Path(payload["path"])
    assert path.parent == out
    data: dict[str, Any] = json.loads(path.read_text())
    assert data["timestamp"] and data["machine"]["nproc"] and data["machine"]["versions"]["celery"]
    return data


def test_throughput_measures_raw_celery_and_both_dex_paths(tmp_path: Path) -> None:
    data = _written(run_throughput(calls=20, rounds=1, stores=["sqlite"], postgres_url=None,
                                   warmup=3, out_dir=tmp_path, console=_quiet()), tmp_path)

    assert [(r["store"], r["variant"]) for r in data["summary"]] == [
        ("sqlite", "raw"), ("sqlite", "read"), ("sqlite", "single")]
    for row in data["summary"]:
        assert row["failures"] == 0, row
        for figure in ("calls_per_s", "vs_raw", "send_p50_ms", "send_p99_ms",
                       "terminal_p50_ms", "terminal_p99_ms"):
            assert row[figure] is not None and row[figure] == row[figure], (figure, row)
    assert {t["target"] for t in data["targets"]} == {
        "read_vs_raw_sqlite", "single_vs_read", "call_tool_vs_apply_async_p50"}


def test_driver_times_the_store_against_the_same_statements_sent_directly(
    tmp_path: Path,
) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_driver(calls=5, rounds=1, stores=stores, postgres_url=POSTGRES_URL,
                               out_dir=tmp_path, console=_quiet()), tmp_path)
    variants = [(r["store"], r["variant"]) for r in data["timings"]]
    expected = [("sqlite", "store"), ("sqlite", "driver"), ("sqlite", "insert_call")]
    if POSTGRES_URL:
        expected += [("postgres", "store"), ("postgres", "driver"), ("postgres", "insert_call"),
                     ("postgres", "insert_cte")]
    assert variants == expected
    for row in data["timings"]:
        assert len(row["rounds_ms"]) == 1 and row["ms_per_call"] > 0, row


def test_held_times_each_store_operation_held_and_pooled(tmp_path: Path) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_held(calls=5, rounds=2, stores=stores, postgres_url=POSTGRES_URL,
                             out_dir=tmp_path, console=_quiet()), tmp_path)
    assert list(data["stores"]) == stores
    for variants in data["stores"].values():
        assert list(variants) == list(VARIANTS)
        for ops in variants.values():
            assert list(ops) == list(OPERATIONS) and all(v > 0 for v in ops.values()), ops


def test_child_times_each_piece_of_a_childs_part_beside_the_floors(tmp_path: Path) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_child(calls=5, rounds=2, stores=stores, postgres_url=POSTGRES_URL,
                              out_dir=tmp_path, console=_quiet()), tmp_path)
    assert list(data["stores"]) == stores
    for kind, variants in data["stores"].items():
        assert list(variants) == ["dex-tasks", "floor"]
        for variant, pieces in variants.items():
            parts = list(ENDING_PARTS) if variant == "dex-tasks" else []
            assert list(pieces) == [*PIECES, *parts], pieces
            # Every piece ran (a piece left out would read 0), and the whole holds them all.
            assert all(pieces[p] > 0 for p in PIECES if p != "the rest"), pieces
            assert pieces["whole"] >= sum(pieces[p] for p in PIECES[:4]), pieces
        # The ending's statements are timed inside it (the read's own are not among them);
        # SQLite's ending is a transaction of its own, PostgreSQL's one autocommit statement.
        dex = variants["dex-tasks"]
        statements, transaction = ENDING_PARTS
        assert 0 < dex[statements] < dex["ending"] + dex["announcement"], dex
        assert (dex[transaction] > 0) is (kind == "sqlite"), dex


def test_producer_times_each_piece_of_call_tool_and_wait_beside_the_floors(
    tmp_path: Path,
) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_producer(calls=5, rounds=2, stores=stores, postgres_url=POSTGRES_URL,
                                 out_dir=tmp_path, console=_quiet()), tmp_path)
    assert list(data["stores"]) == stores
    waits = [f"wait: {p}" for p in WAIT_PIECES]
    for kind, variants in data["stores"].items():
        assert list(variants) == ["dex-tasks", "floor"]
        for pieces in variants.values():
            assert set(pieces) == {*UNTIMED, *PRODUCER_PIECES, *(p for p, _ in PARTS),
                                   *waits}, pieces
            assert all(pieces[p] > 0 for p in ("untimed: call_tool", "untimed: wait",
                                               "whole", "wait: whole", "insert", "publish",
                                               "wait: read")), pieces
            # The Redis command and the message built are parts of both variants' publish.
            for part in ("publish: the message built", "publish: the Redis command"):
                assert 0 < pieces[part] < pieces["publish"], (part, pieces)
        dex = variants["dex-tasks"]
        # Every piece of call_tool ran in dex-tasks (a piece left out would read 0), each
        # part inside its piece.
        assert all(dex[p] > 0 for p in PRODUCER_PIECES[:7]), dex
        for part, piece in PARTS:
            assert dex[part] <= dex[piece], (part, dex)
        assert dex["wait: record"] > 0, dex
        # SQLite's insert is a transaction of its own, PostgreSQL's one autocommit statement.
        assert (dex["insert: its BEGIN and COMMIT"] > 0) is (kind == "sqlite"), dex


def test_overlap_times_the_insert_and_publish_both_ways(tmp_path: Path,
                                                        postgres_url: str) -> None:
    # (postgres_url: PostgreSQL is required, on CI; the bench makes its own fresh database)
    data = _written(run_overlap(calls=5, rounds=1, postgres_url=POSTGRES_URL,
                                out_dir=tmp_path, console=_quiet()), tmp_path)
    assert list(data["variants"]) == list(OVERLAP_VARIANTS)
    for figures in data["variants"].values():
        assert figures["p50_ms"] > 0 and figures["cpu_us"] > 0, figures


def test_sweep_scale_times_every_job_at_each_scale(tmp_path: Path) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_sweeps(scales=[100, 200], overdue=20, repeats=2,
                               jobs=list(DEFAULT_JOBS), stores=stores,
                               postgres_url=POSTGRES_URL or None, out_dir=tmp_path,
                               console=_quiet()), tmp_path)

    # The harness itself refuses a sweep that did not move exactly its overdue group.
    timed = {(t["store"], t["scale"], t["job"]): t for t in data["timings"]}
    assert set(timed) == {(s, n, j) for s in stores for n in (100, 200) for j in DEFAULT_JOBS}
    assert all(t["moved"] == [20, 20] for t in timed.values())
    assert [(t["target"], t["label"]) for t in data["targets"]] == [
        ("sweep_growth", f"{s} 200/100") for s in stores]


def test_memory_samples_the_worker_rss(tmp_path: Path) -> None:
    data = _written(run_memory(calls=20, warmup=10, batch=10, store="sqlite",
                               postgres_url=None, out_dir=tmp_path, console=_quiet()),
                    tmp_path)

    assert data["failures"] == 0
    assert len(data["samples"]) == 3 and data["rss_before_mb"] > 0
    assert len(data["pids"]["children_first"]) == 2
    assert [t["target"] for t in data["targets"]] == ["rss_growth"]


def test_roundtrips_counts_store_and_redis_work_per_call(tmp_path: Path) -> None:
    # A subprocess: the count imports the no-op tools, which must not leak into this one.
    done = subprocess.run(
        [sys.executable, "-m", "bench", "roundtrips", "--calls", "5", "--store", "sqlite",
         "--no-end-to-end", "--out", str(tmp_path)],
        cwd=ROOT, env=child_env({}), capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [path] = tmp_path.glob("roundtrips-*.json")
    phases = json.loads(path.read_text())["phases"]
    by = {(p["path"], p["phase"]): p for p in phases}
    assert by[("read", "call_tool (catalog)")]["sql"]["INSERT"] >= 1
    # A read's start is a lease in Redis (DESIGN version 4): the store sees its end alone; a
    # single-attempt call keeps its durable claim before its end.
    assert by[("read", "worker task body")]["sql"]["UPDATE"] == 1
    assert by[("single", "worker task body")]["sql"]["UPDATE"] >= 2  # claim and finish
    assert by[("single", "worker task body")]["redis"]["set"] == 1  # the Redis claim


def test_latency_times_each_variant_by_the_callers_clock(tmp_path: Path) -> None:
    data = _written(run_latency(calls=4, rounds=2, stores=["sqlite"], postgres_url=None,
                                warmup=2, out_dir=tmp_path, console=_quiet()), tmp_path)

    assert [(r["store"], r["variant"], r["calls"]) for r in data["summary"]] == [
        ("sqlite", "raw", 8), ("sqlite", "read", 8), ("sqlite", "single", 8)]
    for row in data["summary"]:
        assert 0 < row["send_p50_ms"] <= row["total_p50_ms"], row
    assert [(t["target"], t["label"]) for t in data["targets"]] == [
        ("one_at_a_time_vs_raw", "sqlite read"), ("one_at_a_time_vs_raw", "sqlite single")]


def test_batch_compares_call_tools_with_five_call_tool(tmp_path: Path) -> None:
    data = _written(run_batch(turns=3, rounds=2, stores=["sqlite"], postgres_url=None,
                              warmup=1, out_dir=tmp_path, console=_quiet()), tmp_path)

    assert [(r["variant"], r["turns"]) for r in data["summary"]] == [
        ("call_tools", 6), ("call_tool x5", 6)]
    for row in data["summary"]:
        assert 0 < row["send_p50_ms"] <= row["total_p50_ms"], row


def test_io_runs_celery_and_dex_tasks_on_the_threads_pool(tmp_path: Path) -> None:
    data = _written(run_io(calls=20, seconds=0.1, concurrency=10, rounds=1, stores=["sqlite"],
                           postgres_url=None, out_dir=tmp_path, console=_quiet()), tmp_path)

    variants = ["raw", "dex", "burst"] if threads_pool_supported() else ["raw"]
    assert [r["variant"] for r in data["summary"]] == variants
    for row in data["summary"]:
        assert row["failures"] == 0 and row["wall_s"] > 0 and row["peak_rss_mb"] > 0, row
    if variants == ["raw"]:
        assert data["config"]["skipped"] and data["targets"][0]["measured"] is None
    else:
        assert [t["target"] for t in data["targets"]] == ["io_wall_vs_raw", "io_rss",
                                                          "io_wall_vs_raw"]


def test_profile_prints_where_the_producers_time_goes(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), width=200)
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = run_profile(stores=stores, postgres_url=POSTGRES_URL or None, calls=20, top=5,
                       console=console, out_dir=tmp_path)

    assert list(data["stores"]) == stores
    for kind, row in data["stores"].items():
        assert row["call_tool_p50_ms"] > 0 and row["burst_call_tools_s"] > 0
        assert row["insert_call_p50_ms"] > 0
        # one durable commit of a trivial row: measured on PostgreSQL only
        assert (row["durable_commit_p50_ms"] is not None) == (kind == "postgres")
        assert len(row["top"]) == 5 and abs(sum(row["areas"].values()) - 1) < 0.01
    assert [t["target"] for t in data["targets"]] == (
        ["call_tool_alone_vs_apply_async"] * len(stores) + ["burst_send_vs_raw"] * len(stores))
    assert "most time of their own" in console.file.getvalue()  # type: ignore[attr-defined]


def test_scrape_times_metrics_against_ended_calls(tmp_path: Path) -> None:
    stores = ["sqlite", "postgres"] if POSTGRES_URL else ["sqlite"]
    data = _written(run_scrape(scales=[500], open_calls=30, repeats=2, stores=stores,
                               postgres_url=POSTGRES_URL or None, out_dir=tmp_path,
                               console=_quiet()), tmp_path)

    assert [(t["store"], t["ended"]) for t in data["timings"]] == [
        (s, n) for s in stores for n in (0, 500)]
    assert all(t["scrape_ms"] > 0 and t["old_scan_ms"] > 0 for t in data["timings"])
    assert [t["target"] for t in data["targets"]] == ["scrape_growth"] * len(stores)


def test_many_tools_measures_each_catalog_size_and_names_one_key_per_queue(
    tmp_path: Path,
) -> None:
    data = _written(run_many_tools(counts=[3, 12], idle=1, latency_calls=3, burst=12,
                                   out_dir=tmp_path, console=_quiet()), tmp_path)
    assert [run["tools"] for run in data["runs"]] == [3, 12]
    for run in data["runs"]:
        # One list per queue (no priority steps): the tools' queues and reconcile (webhooks
        # are consumed by the main process's sender, outside the pool: worker/webhooks.py).
        assert run["brpop_keys"] == run["tools"] + 1, run
        assert run["burst_calls_per_s"] > 0 and run["latency_p50_ms"] > 0


def test_pooler_times_a_calls_writes_direct_and_through_pgbouncer(tmp_path: Path) -> None:
    from bench.pooler import VARIANTS, run_pooler
    from tests.pgbouncer import require_pgbouncer

    if not POSTGRES_URL:
        import pytest

        pytest.skip("DEX_TEST_POSTGRES_URL is not set")
    require_pgbouncer()
    data = _written(run_pooler(calls=3, rounds=1, postgres_url=POSTGRES_URL, out_dir=tmp_path,
                               console=_quiet()), tmp_path)
    assert [row["variant"] for row in data["rows"]] == list(VARIANTS)
    assert all(row["ms_per_call"] > 0 and len(row["rounds_ms"]) == 1 for row in data["rows"])
    assert data["command"] == "python -m bench pooler --calls 3 --rounds 1"


def test_workload_runs_designs_shape_beside_the_old_one_with_cpu_per_process(
    tmp_path: Path,
) -> None:
    from bench.workload import PHASES
    from bench.workload_report import run_workload

    data = _written(run_workload(
        calls=12, rounds=1, stores=["sqlite"], postgres_url=None, warmup=2, latency_calls=2,
        io_calls=6, io_seconds=0.05, io_concurrency=4, io_rounds=1, with_old=True,
        command="python -m bench workload --calls 12", out_dir=tmp_path, console=_quiet()),
        tmp_path)

    assert data["command"] == "python -m bench workload --calls 12"
    assert [(r["store"], r["shape"], r["calls"]) for r in data["throughput"]] == [
        ("sqlite", "design", 12), ("sqlite", "old", 3)]
    for row in data["throughput"]:
        assert row["failures"] == 0 and row["vs_raw"] > 0, row
        assert set(row["dex_cpu_us_per_call"]) == {
            "producer", "worker main", "children", "redis", "total"}, row
    [one] = data["one_at_a_time"]
    assert one["calls"] == 2 and one["dex_p50_ms"] > 0 and one["raw_p50_ms"] > 0
    # Where the time of a call made alone goes, from its own clock marks and its events
    assert list(one["phases_p50_ms"]) == list(PHASES)
    assert one["phases_p50_ms"]["call_tool"] > 0 and one["phases_p50_ms"]["in the worker"] > 0
    [io] = data["io"]
    assert set(io["vs_raw"]) == {"dex polled", "dex wait"} and io["wall_s"]["raw"] > 0


def test_gap_walks_from_the_old_shape_to_designs_one_factor_at_a_time(tmp_path: Path) -> None:
    from bench.workload import GAP
    from bench.workload_report import run_gap

    data = _written(run_gap(calls=8, rounds=1, stores=["sqlite"], postgres_url=None, warmup=2,
                            command="python -m bench gap --calls 8", out_dir=tmp_path,
                            console=_quiet()), tmp_path)

    assert [r["shape"] for r in data["throughput"]] == [s.name for s in GAP]
    aof = {s["name"]: s["aof"] for s in data["config"]["shapes"]}
    assert aof["old"] is False and aof["old+aof"] is True and aof["design"] is True
    assert all(r["failures"] == 0 for r in data["throughput"])


def test_designs_shape_spreads_calls_round_robin_with_a_turn_each() -> None:
    from bench.workload import DESIGN, OLD

    assert [DESIGN.place(i) for i in (0, 19, 20, 1999)] == [
        ("s0", "t0"), ("s19", "t0"), ("s0", "t1"), ("s19", "t99")]
    # the old benchmark: ten consecutive calls per session, all in one turn
    assert [OLD.place(i) for i in (0, 9, 10, 499)] == [
        ("s0", "t"), ("s0", "t"), ("s1", "t"), ("s49", "t")]


def test_pgindex_costs_each_hot_statement_and_index_and_explains_the_reads(
    tmp_path: Path,
) -> None:
    from bench.pgindex import read_queries, run_pgindex

    # a private PostgreSQL with pg_stat_statements and auto_explain (the machine's binaries)
    data = _written(run_pgindex(calls=3, rounds=1, postgres_url=None, populate_ended=200,
                                command="python -m bench pgindex --calls 3", out_dir=tmp_path,
                                console=_quiet()), tmp_path)

    relations = {r["relation"]: r for r in data["relations"]}
    # the tables and the indexes the path writes, each with its WAL per call, both schemas
    assert relations["dex_tool_calls"]["head_bytes"] > 0
    assert relations["ix_dex_calls_status_tool_effect"]["full_bytes"] > 0
    assert relations["ix_dex_calls_status_lease"]["partial_at_head"]
    assert set(data["totals"]) == {"head", "full"}
    assert data["statements"] and all(s["calls_per_call"] > 0 for s in data["statements"])
    assert any("dex_tool_calls" in plan for plan in data["hot_plans"])
    assert [r["query"] for r in data["read_plans"]] == list(read_queries(0.0))
    assert all(r["custom"] and r["generic"] for r in data["read_plans"])


def test_floor_runs_celery_the_contracts_floor_and_dex_tasks_side_by_side(
    tmp_path: Path,
) -> None:
    from bench.floor import CPU_GROUPS, VARIANTS, run_floor_bench

    data = _written(run_floor_bench(
        calls=12, rounds=1, stores=["sqlite"], postgres_url=None, warmup=2, latency_calls=2,
        command="python -m bench floor --calls 12", out_dir=tmp_path, console=_quiet()),
        tmp_path)

    assert data["command"] == "python -m bench floor --calls 12"
    [store] = data["stores"]
    assert [r["variant"] for r in store["rows"]] == list(VARIANTS)
    for row in store["rows"]:
        assert row["calls_per_s"] > 0 and row["one_p50_ms"] > 0, row
        assert set(row["cpu_us_per_call"]) == set(CPU_GROUPS), row
    assert store["rows"][0]["vs_raw"] == 1.0  # Celery against itself
    assert len(store["runs"]) == len(VARIANTS)
    # one call at a time, phase by phase, from the events each one's ending wrote
    from bench.workload import PHASES
    phased = {r["variant"]: r["phases_p50_ms"] for r in store["rows"] if r["phases_p50_ms"]}
    assert set(phased) == {"floor", "noread", "dex"}  # narrow endings write no start event
    for phases in phased.values():
        assert list(phases) == list(PHASES) and phases["call_tool"] > 0, phases


def test_floor_measures_each_call_alone_after_another_workers_call() -> None:
    """A worker that has just run a call starts the next one sooner: in ``bench floor``'s
    one-call-at-a-time part no call follows one on its own worker (the floors share one),
    even from one turn to the next, and every variant is measured."""
    from bench.floor import FLOORS, ONE_AT_A_TIME, VARIANTS

    def worker(variant: str) -> str:
        return "floor" if variant in FLOORS else variant

    assert set(ONE_AT_A_TIME) == set(VARIANTS)
    previous = ONE_AT_A_TIME[-1]  # the last call of the turn before
    for variant in ONE_AT_A_TIME:
        assert worker(variant) != worker(previous), (previous, variant)
        previous = variant


def test_the_floor_writes_the_rows_the_store_writes_for_a_call(database_url: str) -> None:
    """The floor is only a floor if it does the store's work: the same rows, events and tool
    message for a call requested, read and ended (the store's leased ending, as a worker's
    child writes it)."""
    from bench.floor_tasks import Floor
    from bench.held import leased_ending
    from dex_tasks.store import CALLS, EVENTS, MESSAGES, Store

    store = Store(database_url)
    store.create_all()
    floor = Floor(database_url)
    try:
        now = time.time()
        store.insert_call({"key": "s/t/store", "session_id": "s", "turn_id": "t",
                           "tool_call_id": "c", "tool": "noop", "arguments": "{}",
                           "effect": "read", "requires_approval": False, "max_attempts": 3,
                           "status": "queued", "attempts": 0, "created_at": now,
                           "updated_at": now})
        assert store.get_call("s/t/store") is not None
        leased_ending(store, "s/t/store")
        floor.insert("s/t/floor", "s", "t", "c", "noop")
        assert floor.read("s/t/floor") == "queued"
        floor.end("s/t/floor", "bench@host:1", time.time())
        floor.end("s/t/floor", "bench@host:1", time.time())  # ended: changes nothing
        assert floor.read("s/t/floor") == "succeeded"

        def written(key: str) -> tuple[Any, ...]:
            with store.read() as conn:
                call = conn.execute(select(CALLS.c.status, CALLS.c.prev_status,
                                           CALLS.c.attempts, CALLS.c.result, CALLS.c.worker,
                                           CALLS.c.lease_expires_at)
                                    .where(CALLS.c.key == key)).one()
                events = conn.execute(select(EVENTS.c.session_id, EVENTS.c.event,
                                             EVENTS.c.from_status, EVENTS.c.to_status)
                                      .where(EVENTS.c.key == key)
                                      .order_by(EVENTS.c.id)).all()
                messages = conn.execute(select(
                    MESSAGES.c.session_id, MESSAGES.c.role, MESSAGES.c.turn_id,
                    MESSAGES.c.tool_call_id, MESSAGES.c.tool, MESSAGES.c.call_status,
                    MESSAGES.c.tool_arguments, MESSAGES.c.tool_output, MESSAGES.c.status,
                    MESSAGES.c.step).where(MESSAGES.c.key == key)).all()
            return tuple(call), [tuple(e) for e in events], [tuple(m) for m in messages]

        ours, theirs = written("s/t/floor"), written("s/t/store")
        assert ours == theirs
        assert [e[1] for e in ours[1]] == ["tool_call_requested", "tool_call_started",
                                           "tool_call_finished"]
        # The lean floor (a narrower contract, priced): the same call row, the end's event
        # alone after the request's, no tool message.
        floor.insert("s/t/lean", "s", "t", "c", "noop")
        floor.end("s/t/lean", "bench@host:1", time.time(), lean=True)
        call, events, messages = written("s/t/lean")
        assert call == theirs[0]
        assert [e[1:] for e in events] == [("tool_call_requested", None, "queued"),
                                           ("tool_call_finished", "queued", "succeeded")]
        assert messages == []
    finally:
        floor.close()
        store.close()
