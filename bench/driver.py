"""Where a call's store time goes: the store's Python against the database itself (issue 12).

The worker's part of a call is a claim (one transaction: the guarded UPDATE and its event) and
a finish (one transaction: the guarded UPDATE, the transcript's tool message and the event).
This benchmark runs them for N calls per round in three ways on the same database, alternating
the order per round:

- ``store``: ``Store.claim`` and ``Store.transition``, what a worker runs (without the Redis
  notification and metrics a worker adds after the commit);
- ``driver``: the same statements, hand-written, sent through the DB-API connection directly
  (psycopg or sqlite3), commits included: what the database itself costs;
- and for ``call_tool``'s insert (the call and its first event): ``Store.insert_call``
  against, on PostgreSQL, the two inserts as one statement (a data-modifying CTE) in
  autocommit, which saves the ``BEGIN``/``COMMIT`` round trips.

The gap between ``store`` and ``driver`` is the client-side Python per call; the CTE row says
what fewer round trips would buy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import bindparam, insert, literal, select

from bench.infra import BenchError, bench_session, fresh_store, median, save_results
from dex_tasks.states import CallStatus
from dex_tasks.store import CALLS, EVENTS, Store
from dex_tasks.store.connections import store_now

OWNER = "bench@host:1"


def call_row(key: str, now: float) -> dict[str, Any]:
    return {"key": key, "session_id": key.split("/")[0], "turn_id": "t",
            "tool_call_id": key.split("/")[-1], "tool": "noop", "arguments": '{"n":1}',
            "effect": "read", "requires_approval": False, "max_attempts": 3, "time_limit": None,
            "status": CallStatus.QUEUED.value, "attempts": 0, "published_at": now,
            "created_at": now, "updated_at": now}


class Driver:
    """The worker's statements written out for one engine, run on a raw DB-API connection."""

    def __init__(self, store: Store) -> None:
        self.postgres = not store.is_sqlite
        self.raw = store.engine.raw_connection()
        # The store's clock, as the store itself writes it (connections.store_now).
        self.now_sql = str(store_now().compile(dialect=store.engine.dialect))
        if self.postgres:
            self.json, self.mark = "::jsonb", "%s"
            # the per-session delivery lock a terminal move takes in its RETURNING (store.py)
            lock = f", pg_advisory_xact_lock({0x64657801}, hashtext(session_id))"
        else:
            self.json, self.mark, lock = "", "?", ""
        self.claim_sql = self._sql(
            "UPDATE dex_tool_calls SET prev_status=status, status='running', "
            "attempts=attempts+1, worker=%s, lease_expires_at={now}+%s, updated_at=%s "
            "WHERE key=%s AND status='queued' RETURNING *")
        self.finish_sql = self._sql(
            "UPDATE dex_tool_calls SET prev_status=status, status='succeeded', "
            "result=%s{json}, lease_expires_at=NULL, finished_at=%s, updated_at=%s "
            "WHERE key=%s AND status IN ('running') AND worker=%s RETURNING key, session_id, "
            "prev_status, turn_id, tool_call_id, tool, arguments, result, error, effect, "
            "created_at" + lock)
        self.event_sql = self._sql(
            "INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, "
            "detail, created_at) VALUES (%s, %s, %s, %s, %s, %s{json}, %s)")
        self.event_queued_sql = self.event_sql + self._sql(
            " RETURNING EXISTS (SELECT 1 FROM dex_messages WHERE status='queued' "
            "AND session_id=%s)")
        self.message_sql = self._sql(
            "INSERT INTO dex_messages (session_id, role, status, created_at, turn_id, "
            "tool_call_id, tool, key, call_status, tool_arguments, tool_output) VALUES "
            "(%s, 'tool', NULL, %s, %s, %s, %s, %s, 'succeeded', %s, %s)")

    def _sql(self, text: str) -> str:
        return text.replace("{now}", self.now_sql).replace("{json}", self.json).replace(
            "%s", self.mark)

    def _begin(self, cur: Any) -> None:
        if not self.postgres:
            cur.execute("BEGIN IMMEDIATE")  # what the store's SQLite writers do

    def call(self, key: str) -> None:
        """Claim and finish ``key``, as a worker does."""
        now = time.time()
        cur = self.raw.cursor()
        self._begin(cur)
        cur.execute(self.claim_sql, (OWNER, 30.0, now, key))
        row = cur.fetchone()
        if row is None:
            raise BenchError(f"the driver's claim of {key} matched nothing")
        cur.execute(self.event_sql, (key.split("/")[0], key, "tool_call_started", "queued",
                                     "running", json.dumps({"attempt": 1, "worker": OWNER}),
                                     now))
        self.raw.commit()
        self._begin(cur)
        cur.execute(self.finish_sql, ("1", now, now, key, OWNER))
        moved = cur.fetchone()
        if moved is None:
            raise BenchError(f"the driver's finish of {key} matched nothing")
        _key, session, _prev, turn, call_id, tool, arguments = moved[:7]
        if not isinstance(arguments, str):  # psycopg reads jsonb as Python values
            arguments = json.dumps(arguments)
        cur.execute(self.message_sql, (session, now, turn, call_id, tool, key, arguments, "1"))
        cur.execute(self.event_queued_sql, (session, key, "tool_call_finished", "running",
                                            "succeeded", None, now, session))
        cur.fetchone()
        self.raw.commit()
        cur.close()

    def close(self) -> None:
        self.raw.close()


def _store_call(store: Store, key: str) -> None:
    if store.claim(key, OWNER, 30.0, lambda row: None) is None:
        raise BenchError(f"the store's claim of {key} matched nothing")
    if not store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                            match={"worker": OWNER}, values={"result": "1"}):
        raise BenchError(f"the store's finish of {key} matched nothing")


def _cte_insert() -> Any:
    """``call_tool``'s two inserts as one PostgreSQL statement (a data-modifying CTE)."""
    row = call_row("s/t/c", 0.0)
    new = (insert(CALLS)
           .values({k: bindparam(f"c_{k}", type_=CALLS.c[k].type) for k in row})
           .returning(CALLS.c.key, CALLS.c.session_id, CALLS.c.status, CALLS.c.created_at)
           .cte("new_call"))
    return insert(EVENTS).from_select(
        ["session_id", "key", "event", "from_status", "to_status", "detail", "created_at"],
        select(new.c.session_id, new.c.key, literal("tool_call_requested"),
               literal(None, EVENTS.c.from_status.type), new.c.status,
               bindparam("e_detail", type_=EVENTS.c.detail.type), new.c.created_at))


REQUESTED = {"default_effect": None}  # the request options call_tool keeps in the first event


def _insert_store(store: Store, key: str) -> None:
    store.insert_call(call_row(key, time.time()), requested=REQUESTED)


def _insert_cte(store: Store, statement: Any, key: str) -> None:
    params = {f"c_{k}": v for k, v in call_row(key, time.time()).items()}
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(statement, {**params, "e_detail": json.dumps({"request": REQUESTED})})


def time_store(kind: str, url: str, calls: int, rounds: int) -> list[dict[str, Any]]:
    """Every variant on one fresh store, interleaved; one row per variant."""
    store = Store(url)
    store.create_all()
    driver = Driver(store)
    variants: dict[str, tuple[str, Callable[[str], None]]] = {
        "store": ("claim + finish", partial(_store_call, store)),
        "driver": ("claim + finish", driver.call),
        "insert_call": ("call_tool's insert", partial(_insert_store, store)),
    }
    if not store.is_sqlite:
        variants["insert_cte"] = ("call_tool's insert", partial(_insert_cte, store, _cte_insert()))
    timings: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for rnd in range(rounds + 1):  # round 0 warms the pools and the prepared statements
            for name in list(variants) if rnd % 2 == 0 else list(variants)[::-1]:
                keys = [f"{name}{rnd}/t/c{i}" for i in range(calls)]
                if not name.startswith("insert"):
                    for key in keys:
                        store.insert_call(call_row(key, time.time()))
                run = variants[name][1]
                start = time.perf_counter()
                for key in keys:
                    run(key)
                if rnd:
                    timings[name].append((time.perf_counter() - start) / calls)
    finally:
        driver.close()
        store.close()
    return [{"store": kind, "variant": name, "what": what,
             "ms_per_call": round(median(timings[name]) * 1000, 3),
             "rounds_ms": [round(t * 1000, 3) for t in timings[name]]}
            for name, (what, _) in variants.items()]


def run_driver(
    *,
    calls: int,
    rounds: int,
    stores: list[str],
    postgres_url: str | None,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Time each variant on every store; print the table; write the results."""
    if calls < 1 or rounds < 1:
        raise BenchError(f"--calls and --rounds must be at least 1, got {calls} and {rounds}")
    console = console or Console()
    rows: list[dict[str, Any]] = []
    with bench_session("driver", stores, postgres_url) as (_redis, machine, workdir):
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url, \
                    console.status(f"{kind}: {rounds} rounds x {calls} calls per variant"):
                rows += time_store(kind, url, calls, rounds)
    print_table(console, rows, calls, rounds)
    # No target of its own: it explains the throughput and latency ones.
    payload = {"config": {"calls": calls, "rounds": rounds, "stores": stores},
               "machine": machine, "timings": rows, "targets": []}
    return save_results("driver", payload, out_dir, console)


def print_table(console: Console, rows: list[dict[str, Any]], calls: int, rounds: int) -> None:
    table = Table(title=f"The store's Python vs the database: {calls} calls x {rounds} rounds "
                        "per variant, interleaved")
    for column in ("store", "variant", "what", "ms per call", "rounds ms"):
        table.add_column(column, justify="right" if column.startswith(("ms", "rounds"))
                         else "left")
    for r in rows:
        table.add_row(r["store"], r["variant"], r["what"], f"{r['ms_per_call']:.2f}",
                      " ".join(f"{t:.2f}" for t in r["rounds_ms"]))
    table.caption = ("store: Store.claim + Store.transition (no Redis notification or "
                     "metrics); driver: the same statements through the DB-API connection; "
                     "insert_cte: call_tool's two inserts as one statement in autocommit. "
                     "Median over rounds")
    console.print(table)
