"""PostgreSQL per call: what each statement and each index of the hot path costs (issue 29,
deliverable 3).

On a private PostgreSQL with ``pg_stat_statements`` and ``auto_explain`` loaded (or the server
of ``--postgres-url``, which must preload both), a fresh store at head runs N calls' hot path
through the store: ``insert_call`` (``call_tool``'s write), ``claim``, the terminal
``transition`` and ``get_call`` (the waiter's read). Then:

* **statements**: ``pg_stat_statements`` per statement of that path: calls, mean execution
  time, shared blocks hit and dirtied, WAL bytes, per call;
* **indexes**: the same N calls with each secondary index of the tables the path writes
  (calls, events, messages) dropped in turn, and each partial index in its full form; an
  index's cost is what the path costs with it minus without it: WAL bytes per call (exact; the
  private server runs with ``full_page_writes = off`` so that checkpoints do not add page
  images to whichever variant comes first after one) and execution time per call
  (``pg_stat_statements``, noisy on a loaded machine);
* **plans**: ``EXPLAIN (ANALYZE, BUFFERS)`` of the hot statements as the server ran them
  (``auto_explain``), and of the sweep, snapshot, session, prune and ``/metrics`` reads over a
  populated store (ended, running, queued and unreported calls), each as a custom plan and as
  the generic plan a prepared statement gets, with the index each one uses.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from psycopg import sql
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from bench.infra import (
    BenchError,
    fresh_store,
    machine_info,
    median,
    reset_statement_stats,
    save_results,
    statement_stats,
)
from bench.workload import private_postgres
from dex_tasks.broker.metrics import open_calls_query
from dex_tasks.states import TERMINAL, CallStatus
from dex_tasks.store import CALLS, EVENTS, MESSAGES, Store
from dex_tasks.store.prune import candidates
from dex_tasks.store.records import ToolCallRecord

OWNER = "bench@host:1"
HOT_TABLES = (CALLS.name, EVENTS.name, MESSAGES.name)
REQUESTED = {"default_effect": None}
SERVER_SETTINGS = {"shared_preload_libraries": "pg_stat_statements,auto_explain",
                   "pg_stat_statements.track": "all",
                   # WAL bytes then count the records alone, not the full-page images a page's
                   # first change after a checkpoint adds (which fall on whichever variant
                   # runs first after one, and hide an index's own cost).
                   "full_page_writes": "off"}


def call_row(key: str, now: float) -> dict[str, Any]:
    """A new no-op ``read`` call, as ``call_tool`` records it."""
    session, turn, call_id = key.split("/")
    return {"key": key, "session_id": session, "turn_id": turn, "tool_call_id": call_id,
            "tool": "noop", "arguments": '{"n":1}', "effect": "read",
            "requires_approval": False, "max_attempts": 3, "time_limit": None,
            "status": CallStatus.QUEUED.value, "attempts": 0, "published_at": now,
            "created_at": now, "updated_at": now}


def hot_path(store: Store, key: str) -> None:
    """One call's store work: requested, claimed, ended, read by its waiter."""
    store.insert_call(call_row(key, time.time()), requested=REQUESTED)
    if store.claim(key, OWNER, 30.0, lambda row: None) is None:
        raise BenchError(f"the claim of {key} matched nothing")
    if not store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                            match={"worker": OWNER}, values={"result": "1"}):
        raise BenchError(f"the end of {key} matched nothing")
    if store.get_call(key) is None:
        raise BenchError(f"{key} was not read back")


# -- statements and indexes ---------------------------------------------------------------------


def run_calls(store: Store, admin: Engine, calls: int, tag: str) -> dict[str, Any]:
    """N calls' hot path: pg_stat_statements per statement, the WAL each relation was written
    (pg_walinspect, by the relation of each record's first block), and the client's wall."""
    reset_statement_stats(admin)
    with admin.connect() as conn:
        first = conn.execute(text("SELECT pg_current_wal_insert_lsn()")).scalar()
    start = time.perf_counter()
    for i in range(calls):
        hot_path(store, f"{tag}/t/c{i}")
    wall = time.perf_counter() - start
    stats = statement_stats(admin)
    with admin.connect() as conn:
        # (a synchronous commit ended each call, so its records are flushed)
        last = conn.execute(text("SELECT pg_current_wal_flush_lsn()")).scalar()
        rels = conn.execute(text(
            "SELECT coalesce(c.relname, '(no relation: commits, ...)') AS rel, count(*) AS n, "
            "sum(w.record_length) AS bytes FROM pg_get_wal_records_info(:a, :b) w "
            "LEFT JOIN pg_class c ON c.relfilenode = "
            "  (substring(w.block_ref from 'rel \\d+/\\d+/(\\d+)'))::oid "
            "WHERE w.block_ref = '' OR w.block_ref ~ ('rel \\d+/' || "
            "  (SELECT oid FROM pg_database WHERE datname = current_database()) || '/') "
            "GROUP BY 1"), {"a": first, "b": last}).mappings().all()
    per = 1.0 / calls
    return {"wall_ms": wall * 1000 * per,
            "exec_ms": sum(float(s["total_exec_time"]) for s in stats) * per,
            "wal_bytes": sum(int(s["wal_bytes"]) for s in stats) * per,
            "relations": {r["rel"]: (int(r["n"]) * per, int(r["bytes"]) * per) for r in rels},
            "statements": stats}


def partial_indexes(engine: Engine) -> list[tuple[str, str]]:
    """(index, definition) of every partial index of the hot tables."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT i.relname, pg_get_indexdef(x.indexrelid) FROM pg_index x "
            "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
            "WHERE t.relname = ANY(:tables) AND x.indpred IS NOT NULL ORDER BY 1"),
            {"tables": list(HOT_TABLES)}).all()
    return [(r[0], r[1]) for r in rows]


def set_partial(engine: Engine, indexes: list[tuple[str, str]], partial: bool) -> None:
    """The partial indexes as they are (head) or in their full form (migration 0009's)."""
    with engine.begin() as conn:
        for name, definition in indexes:
            conn.execute(text(f'DROP INDEX "{name}"'))
            conn.execute(text(definition if partial else definition.split(" WHERE ")[0]))


SCHEMAS = ("head: partial", "0009: full")


def measure_indexes(store: Store, admin: Engine, calls: int, rounds: int,
                    say: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                       dict[str, Any]]:
    """Per relation (table or index) of the hot path: WAL records and bytes per call, with the
    partial indexes (head) and with their full forms (0009), rounds alternating; the
    statements (head); totals per schema."""
    partial = partial_indexes(store.engine)
    runs: dict[str, list[dict[str, Any]]] = {schema: [] for schema in SCHEMAS}
    hot_path(store, "warm/t/c0")
    for rnd in range(rounds):
        for schema in SCHEMAS if rnd % 2 == 0 else SCHEMAS[::-1]:
            say(f"indexes round {rnd + 1}/{rounds}: {schema}")
            set_partial(store.engine, partial, schema == SCHEMAS[0])
            runs[schema].append(run_calls(store, admin, calls, f"r{rnd}-{schema[:4]}"))
    set_partial(store.engine, partial, True)
    names = sorted({rel for group in runs.values() for run in group for rel in run["relations"]})
    rows = []
    for rel in names:
        row: dict[str, Any] = {"relation": rel, "partial_at_head": rel in dict(partial)}
        for schema, group in runs.items():
            key = "head" if schema == SCHEMAS[0] else "full"
            row[f"{key}_records"] = round(median(
                [run["relations"].get(rel, (0, 0))[0] for run in group]), 2)
            row[f"{key}_bytes"] = round(median(
                [run["relations"].get(rel, (0, 0))[1] for run in group]), 1)
        rows.append(row)
    totals = {("head" if schema == SCHEMAS[0] else "full"): {
        k: round(median([run[k] for run in group]), 4) for k in ("wall_ms", "exec_ms",
                                                                  "wal_bytes")}
        for schema, group in runs.items()}
    return rows, _per_statement(runs[SCHEMAS[0]], calls), totals


def _per_statement(runs: list[dict[str, Any]], calls: int) -> list[dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for s in run["statements"]:
            by.setdefault(s["query"], []).append(s)
    out = []
    for query, seen in by.items():
        n = sum(int(s["calls"]) for s in seen)
        out.append({"query": re.sub(r"\s+", " ", query)[:400],
                    "calls_per_call": round(n / (calls * len(runs)), 2),
                    "mean_ms": round(sum(float(s["total_exec_time"]) for s in seen) / n, 4),
                    "hit_per_exec": round(sum(int(s["shared_blks_hit"]) for s in seen) / n, 1),
                    "dirtied_per_exec": round(
                        sum(int(s["shared_blks_dirtied"]) for s in seen) / n, 2),
                    "wal_bytes_per_exec": round(sum(int(s["wal_bytes"]) for s in seen) / n)})
    return sorted(out, key=lambda s: -s["mean_ms"] * s["calls_per_call"])


def time_record_reads(store: Store, key: str, n: int = 500, rounds: int = 5) -> dict[str, float]:
    """``get_tool_call``'s read two ways, interleaved, best of ``rounds``, in this process's
    CPU µs per read (what the change moves; wall time on a shared machine is mostly waiting):
    the store row validated into a ``ToolCallRow`` then the record, and the record built from
    the plain columns (what ``get_tool_call`` does since issue 29)."""
    def orm() -> ToolCallRecord:
        row = store.get_call(key)
        assert row is not None
        return ToolCallRecord.from_row(row)

    def plain() -> ToolCallRecord:
        row = store.get_call_columns(key)
        assert row is not None
        return ToolCallRecord.from_mapping(row)

    ways: dict[str, Callable[[], ToolCallRecord]] = {
        "ToolCallRow then record": orm, "plain columns then record": plain}
    best = {name: float("inf") for name in ways}
    for _ in range(rounds):
        for name, read in ways.items():
            start = time.process_time()
            for _ in range(n):
                read()
            best[name] = min(best[name], (time.process_time() - start) / n * 1e6)
    return {name: round(us, 1) for name, us in best.items()}


# -- plans --------------------------------------------------------------------------------------


def hot_plans(store: Store, admin: Engine, log: Any) -> list[str]:
    """The hot statements' EXPLAIN (ANALYZE, BUFFERS), as auto_explain logged them."""
    settings = {"auto_explain.log_min_duration": "0", "auto_explain.log_analyze": "on",
                "auto_explain.log_buffers": "on", "auto_explain.log_timing": "on"}
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for name, value in settings.items():
            conn.execute(text(f"ALTER SYSTEM SET {name} = '{value}'"))
        conn.execute(text("SELECT pg_reload_conf()"))
    time.sleep(0.5)  # a reload reaches the backends at their next command
    mark = len(log())
    try:
        hot_path(store, "explain/t/c0")
    finally:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for name in settings:
                conn.execute(text(f"ALTER SYSTEM RESET {name}"))
            conn.execute(text("SELECT pg_reload_conf()"))
    plans = re.split(r"\n(?=\S.*LOG:\s+duration: )", log()[mark:])
    return [p.strip() for p in plans if "dex_" in p and "Query Text" in p]


def populate(engine: Engine, ended: int, running: int, queued: int, unknown: int) -> None:
    """Ended, running (leased), queued and unreported calls, with their tool messages and a few
    queued user messages, in bulk; then ANALYZE."""
    cols = ("key, session_id, turn_id, tool_call_id, tool, arguments, effect, "
            "requires_approval, max_attempts, status, attempts, republishes, created_at, "
            "updated_at, published_at, finished_at, lease_expires_at, worker")
    now = time.time()
    groups = (("e", ended, "succeeded", "now - 86400 + g", "now - 86400 + g", "NULL"),
              ("r", running, "running", "now", "NULL", "now + 30"),
              ("q", queued, "queued", "now - g", "NULL", "NULL"),
              ("u", unknown, "outcome_unknown", "now - 3600", "now - 3600 + g", "NULL"))
    with engine.begin() as conn:
        for prefix, n, status, published, finished, lease in groups:
            if not n:
                continue
            conn.execute(text(
                f"INSERT INTO dex_tool_calls ({cols}) SELECT '{prefix}' || g || '/t/c', "
                f"'{prefix}s' || (g % 500), 't', 'c', 'noop', '{{}}'::jsonb, 'read', false, 3, "
                f"'{status}', 1, 0, :now - 86400 + g, :now, "
                f"{published.replace('now', ':now')}, {finished.replace('now', ':now')}, "
                f"{lease.replace('now', ':now')}, 'w' FROM generate_series(1, {n}) g"),
                {"now": now})
        conn.execute(text(
            "INSERT INTO dex_messages (session_id, role, created_at, turn_id, tool_call_id, "
            "tool, key, call_status, tool_output) SELECT session_id, 'tool', finished_at, "
            "turn_id, tool_call_id, tool, key, status, '1' FROM dex_tool_calls "
            "WHERE finished_at IS NOT NULL"))
        conn.execute(text(
            "INSERT INTO dex_messages (session_id, role, text, status, created_at) "
            "SELECT 'es' || g, 'user', 'hi', 'queued', :now FROM generate_series(1, 50) g"),
            {"now": now})
        conn.execute(text(
            "INSERT INTO dex_call_events (session_id, key, event, to_status, created_at) "
            "SELECT session_id, key, 'tool_call_finished', status, created_at "
            "FROM dex_tool_calls"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))


def read_queries(now: float) -> dict[str, Any]:
    """The reads whose plans the partial indexes must keep on an index (the sweeps, the
    snapshot and session pages, prune, the reconcilers and /metrics)."""
    terminal = [s.value for s in TERMINAL]
    return {
        "expired leases (reaper)": select(CALLS).where(
            CALLS.c.status == CallStatus.RUNNING.value, CALLS.c.lease_expires_at < now
        ).limit(500),
        "stranded, never published": select(CALLS).where(
            CALLS.c.status == CallStatus.QUEUED.value, CALLS.c.published_at.is_(None)
        ).limit(500),
        "stranded, stale publish": select(CALLS).where(
            CALLS.c.status == CallStatus.QUEUED.value, CALLS.c.published_at < now - 60
        ).order_by(CALLS.c.published_at).limit(500),
        "prune page": candidates("succeeded", now - 3600, None, 1000),
        "unreported (reconcilers)": select(CALLS).where(
            CALLS.c.status == CallStatus.OUTCOME_UNKNOWN.value
        ).order_by(CALLS.c.finished_at, CALLS.c.key).limit(100),
        "open calls (/metrics)": open_calls_query(),
        "session's calls (snapshot)": select(CALLS).where(CALLS.c.session_id == "es7")
        .order_by(CALLS.c.created_at, CALLS.c.key),
        "session's open calls": select(CALLS).where(
            CALLS.c.session_id == "es7", CALLS.c.status.not_in(terminal)
        ).order_by(CALLS.c.created_at, CALLS.c.key).limit(100),
        "session's events": select(EVENTS).where(EVENTS.c.session_id == "es7", EVENTS.c.id > 0)
        .order_by(EVENTS.c.id).limit(1000),
        "call's events": select(EVENTS).where(EVENTS.c.key == "e7/t/c").order_by(EVENTS.c.id),
        "queued user messages (delivery)": select(MESSAGES.c.id).where(
            MESSAGES.c.status == "queued", MESSAGES.c.session_id == "es7"),
        "all sessions with queued messages (sweep)": select(MESSAGES.c.session_id).where(
            MESSAGES.c.status == "queued").distinct(),
        "transcript": select(MESSAGES).where(MESSAGES.c.session_id == "es7")
        .order_by(MESSAGES.c.id),
    }


def _plan_summary(plan: dict[str, Any]) -> tuple[list[str], int]:
    """The scans of a JSON plan (``Index Scan on t using i``) and its shared blocks hit."""
    scans: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        kind = node["Node Type"]
        if "Scan" in kind and ("Relation Name" in node or "Index Name" in node):
            on = f" on {node['Relation Name']}" if "Relation Name" in node else ""
            using = f" using {node['Index Name']}" if "Index Name" in node else ""
            scans.append(f"{kind}{on}{using}")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return scans, int(plan["Plan"].get("Shared Hit Blocks", 0))


def _one(cur: Any) -> dict[str, Any]:
    row = cur.fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]
    return plan


def explain_reads(url: str) -> list[dict[str, Any]]:
    """Each read's custom plan (literal values) and generic plan (a prepared statement)."""
    dialect = postgresql.psycopg.dialect(  # type: ignore[no-untyped-call]
        paramstyle="numeric_dollar")
    engine = create_engine(url)
    rows = []
    try:
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert raw is not None
            cur = raw.cursor()
            for i, (name, stmt) in enumerate(read_queries(time.time()).items()):
                literal = str(stmt.compile(dialect=postgresql.dialect(),  # type: ignore[no-untyped-call]
                                           compile_kwargs={"literal_binds": True}))
                cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {literal}")
                custom = _one(cur)
                compiled = stmt.compile(dialect=dialect,  # type: ignore[no-untyped-call]
                                        compile_kwargs={"render_postcompile": True})
                params = [compiled.params[p] for p in (compiled.positiontup or [])]
                cur.execute(f"PREPARE q{i} AS {compiled}")
                cur.execute("SET plan_cache_mode = force_generic_plan")
                args = sql.SQL(", ").join(sql.Literal(p) for p in params)
                cur.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}")
                            .format(sql.Identifier(f"q{i}"))
                            + (sql.SQL("({})").format(args) if params else sql.SQL("")))
                generic = _one(cur)
                cur.execute("RESET plan_cache_mode")
                cur.execute(f"DEALLOCATE q{i}")
                c_scans, c_hit = _plan_summary(custom)
                g_scans, g_hit = _plan_summary(generic)
                rows.append({"query": name, "custom": c_scans, "custom_ms":
                             round(custom["Execution Time"], 3), "custom_hit": c_hit,
                             "generic": g_scans, "generic_ms": round(generic["Execution Time"], 3),
                             "generic_hit": g_hit,
                             "seq_scan_of_calls": any(s.startswith("Seq Scan on dex_tool_calls")
                                                      for s in c_scans + g_scans)})
            raw.rollback()
    finally:
        engine.dispose()
    return rows


# -- the whole run ------------------------------------------------------------------------------


def run_pgindex(*, calls: int, rounds: int, postgres_url: str | None, populate_ended: int,
                command: str, out_dir: Path | None = None,
                console: Console | None = None) -> dict[str, Any]:
    """Measure statements, indexes and plans; print them; write the results."""
    if calls < 1 or rounds < 1:
        raise BenchError(f"--calls and --rounds must be at least 1, got {calls} and {rounds}")
    console = console or Console()
    import shutil
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-pgindex-"))
    try:
        with _server(postgres_url, workdir) as (admin_url, log):
            machine = machine_info(None, admin_url)
            with fresh_store("postgres", admin_url, workdir) as url:
                store = Store(url)
                store.create_all()
                admin = create_engine(url, isolation_level="AUTOCOMMIT")
                try:
                    with admin.connect() as conn:
                        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
                        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
                    indexes, statements, totals = measure_indexes(store, admin, calls, rounds,
                                                                  console.log)
                    plans = hot_plans(store, admin, log) if log else []
                    reads_us = time_record_reads(store, "warm/t/c0")
                    with store.write() as conn:
                        conn.execute(text(f"TRUNCATE {', '.join(HOT_TABLES)}"))
                    console.log(f"populating {populate_ended} ended calls")
                    populate(store.engine, populate_ended, 300, 300, 50)
                    reads = explain_reads(url)
                finally:
                    admin.dispose()
                    store.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    console.print(f"[bold]{command}[/bold]")
    print_statements(console, statements)
    print_indexes(console, indexes, totals)
    print_reads(console, reads, populate_ended)
    console.print("get_tool_call's read, client CPU µs (best of 5 x 500): " + ", ".join(
        f"{name} {us:.0f}" for name, us in reads_us.items()))
    payload = {"command": command, "machine": machine,
               "config": {"calls": calls, "rounds": rounds, "populate_ended": populate_ended},
               "statements": statements, "relations": indexes, "totals": totals,
               "hot_plans": plans,
               "record_read_us": reads_us,
               "read_plans": reads}
    return save_results("pgindex", payload, out_dir, console)


@contextmanager
def _server(postgres_url: str | None, workdir: Path) -> Iterator[tuple[str, Any]]:
    """The admin URL and a reader of the server's log (None: not a private server)."""
    if postgres_url:
        yield postgres_url, None
        return
    with private_postgres(workdir, SERVER_SETTINGS) as (url, _pid, log):
        yield url, log


def print_statements(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="The hot path's statements (pg_stat_statements): insert_call, claim, "
                        "the end, get_call")
    for column in ("per call", "mean ms", "hit", "dirtied", "WAL B", "statement"):
        table.add_column(column, justify="left" if column == "statement" else "right")
    for r in rows:
        table.add_row(f"{r['calls_per_call']:.2f}", f"{r['mean_ms']:.3f}",
                      f"{r['hit_per_exec']:.0f}", f"{r['dirtied_per_exec']:.2f}",
                      str(r["wal_bytes_per_exec"]), r["query"][:110])
    console.print(table)


def print_indexes(console: Console, rows: list[dict[str, Any]],
                  totals: dict[str, Any]) -> None:
    head, full = totals["head"], totals["full"]
    table = Table(title="WAL per call of the hot path by relation (pg_walinspect): with the "
                        "partial indexes (head) and with their full forms (0009)",
                  caption=f"per call: head {head['wal_bytes']:.0f} WAL bytes, "
                          f"{head['exec_ms']:.3f} ms executing, {head['wall_ms']:.2f} ms by "
                          f"the client's clock; 0009 {full['wal_bytes']:.0f} B, "
                          f"{full['exec_ms']:.3f} ms, {full['wall_ms']:.2f} ms (medians of the "
                          "rounds; time is noisy on a shared machine, WAL is exact)")
    for column in ("relation", "records head", "bytes head", "records 0009", "bytes 0009"):
        table.add_column(column, justify="left" if column == "relation" else "right")
    for r in rows:
        table.add_row(r["relation"] + (" (partial)" if r["partial_at_head"] else ""),
                      f"{r['head_records']:.2f}", f"{r['head_bytes']:.0f}",
                      f"{r['full_records']:.2f}", f"{r['full_bytes']:.0f}")
    console.print(table)


def print_reads(console: Console, rows: list[dict[str, Any]], ended: int) -> None:
    table = Table(title=f"Reads over {ended} ended + 300 running + 300 queued + 50 unreported "
                        "calls: the scans of their plans, custom and generic (prepared)")
    for column in ("query", "custom plan", "ms", "generic plan", "ms"):
        table.add_column(column, justify="right" if column == "ms" else "left")
    for r in rows:
        table.add_row(r["query"], "; ".join(r["custom"]), f"{r['custom_ms']:.2f}",
                      "; ".join(r["generic"]), f"{r['generic_ms']:.2f}",
                      style="red" if r["seq_scan_of_calls"] else None)
    console.print(table)
