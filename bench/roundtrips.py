"""Round trips per call: what one dex-tasks call costs in store statements, transactions,
new database connections and Redis commands, side by side with plain Celery.

Two parts:

1. In this process, with SQLAlchemy event listeners on the stores' engines, per call:
   the agent's ``call_tool`` (tool code not imported: the policy comes from the catalog a
   subprocess published), the worker's task body (``run_retrying`` / ``run_single_attempt``
   called directly, as the Celery child would, without Celery around it), the agent's ``wait``
   on a call already terminal, and ``call_tool`` once the tool is imported locally. Redis
   commands of each phase come from the private server's ``INFO commandstats``.
2. End to end with the real workers of the throughput benchmark: Redis commands per call for
   raw Celery (apply_async + result backend + get) and the two dex-tasks paths (publish,
   consume, ack, claim), counted by the Redis server.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine, event

from bench.infra import (
    READ_TOOL,
    SINGLE_ATTEMPT_TOOL,
    TOOLS_MODULE,
    BenchError,
    RedisServer,
    child_env,
    fresh_store,
    machine_info,
    save_results,
)
from bench.throughput import DEX_DB, Bench, session_for
from dex_tasks import DexClient, DexSettings
from dex_tasks.store import Store

TOOLS = {"read": READ_TOOL, "single": SINGLE_ATTEMPT_TOOL}


class SqlCounter:
    """Counts what a store's engines send: statements by verb, transactions, new connections.

    On SQLite the statements are counted by ``sqlite3`` itself (its trace callback, set on
    every connection the engines open from now on): the store's hot path sends them on the
    DB-API connection (``dex_tasks/store/driver.py``), where SQLAlchemy's execute events do
    not see them."""

    def __init__(self, store: Store) -> None:
        self.counts: Counter[str] = Counter()
        self.store = store
        self.engines: list[Engine] = [store.engine]
        if store.read_engine is not store.engine:
            self.engines.append(store.read_engine)
        self._hooks: list[tuple[Engine, str, Callable[..., None]]] = []
        for engine in self.engines:
            self._listen(engine, "connect", lambda *_: self._add("connect"))
            if store.is_sqlite:
                store.close()  # connections opened before (held, pooled) would go untraced
                self._listen(engine, "connect", self._trace)
            else:
                self._listen(engine, "before_cursor_execute", self._statement)
            self._listen(engine, "commit", lambda *_: self._add("commit"))
            self._listen(engine, "rollback", lambda *_: self._add("rollback"))

    def _trace(self, dbapi_conn: Any, _record: Any) -> None:
        def traced(statement: str) -> None:
            # COMMIT and ROLLBACK are counted by the engine's events, as on PostgreSQL
            if statement.split(None, 1)[:1] not in (["COMMIT"], ["ROLLBACK"]):
                self._statement(None, None, statement)

        dbapi_conn.set_trace_callback(traced)

    def _listen(self, engine: Engine, name: str, fn: Callable[..., None]) -> None:
        event.listen(engine, name, fn)
        self._hooks.append((engine, name, fn))

    def _add(self, kind: str) -> None:
        self.counts[kind] += 1

    def _statement(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
        self.counts["statements"] += 1
        self.counts[verb] += 1

    def snapshot(self) -> Counter[str]:
        return Counter(self.counts)

    def remove(self) -> None:
        for engine, name, fn in self._hooks:
            event.remove(engine, name, fn)
            if fn == self._trace:
                self.store.close()  # the traced connections
        self._hooks.clear()


@dataclass
class Phase:
    """Per-call counts of one phase."""

    store: str
    path: str
    phase: str
    calls: int
    sql: Counter[str]
    redis: Counter[str]
    seconds: float

    def per_call(self) -> dict[str, Any]:
        def per(c: Counter[str]) -> dict[str, float]:
            return {k: round(v / self.calls, 2) for k, v in sorted(c.items()) if v}

        return {"store": self.store, "path": self.path, "phase": self.phase,
                "calls": self.calls, "sql": per(self.sql), "redis": per(self.redis),
                "ms_per_call": round(self.seconds / self.calls * 1000, 3)}


@dataclass
class Measure:
    """Counts SQL on some stores and Redis commands on the server while a block runs."""

    redis_server: RedisServer
    counters: list[SqlCounter] = field(default_factory=list)

    def run(self, store: str, path: str, phase: str, calls: int,
            body: Callable[[], None]) -> Phase:
        sql_before = [c.snapshot() for c in self.counters]
        redis_before = Counter(self.redis_server.commandstats())
        start = time.perf_counter()
        body()
        seconds = time.perf_counter() - start
        redis_after = Counter(self.redis_server.commandstats())
        sql: Counter[str] = Counter()
        for counter, before in zip(self.counters, sql_before, strict=True):
            sql.update(counter.snapshot() - before)
        redis = redis_after - redis_before
        redis["info"] -= 1  # our own INFO commandstats
        return Phase(store, path, phase, calls, sql, +redis, seconds)


class _StubRequest:
    hostname = "bench-inprocess@host"
    # The name a live delivery's request carries (``dex.call_tool[<tool>]`` for a retrying
    # call, set per tool below); None as Celery's own request has it when a message names none.
    shadow: str | None = None


class StubTask:
    """What the task bodies read from the bound Celery task: the app and the request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.request = _StubRequest()


def publish_catalog(database_url: str) -> None:
    """Publish the no-op tools' catalog from a subprocess, so this one never imports them."""
    code = ("import bench.noop_tools\n"
            "from dex_tasks.store import catalog\n"
            "from dex_tasks.registry import local_tools\n"
            "from dex_tasks.store import Store\n"
            f"s = Store({database_url!r}); s.create_all()\n"
            "catalog.publish(s, local_tools().values()); s.close()\n")
    done = subprocess.run([sys.executable, "-c", code], env=child_env({}), capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise BenchError(f"publishing the catalog failed:\n{done.stderr[-2000:]}")


def _send(client: DexClient, session: str, tool: str, calls: int, keys: list[str]) -> None:
    keys += [client.call_tool(session_id=session_for(session, i), turn_id="t",
                              tool_call_id=f"c{i}", tool=tool).key for i in range(calls)]


def _work(body: Callable[[Any, str], None], task: StubTask, keys: list[str]) -> None:
    for key in keys:
        body(task, key)


def _wait(client: DexClient, keys: list[str]) -> None:
    for key in keys:
        try:
            client.wait(key, timeout=5)
        except TimeoutError as err:
            raise BenchError(f"the task body left a call unfinished: {err}") from err


def in_process(redis_server: RedisServer, stores: list[str], postgres_url: str | None,
               calls: int, workdir: Path) -> list[Phase]:
    from dex_tasks import registry
    from dex_tasks.broker.celery_app import RUN_RETRYING, shadow_name
    from dex_tasks.worker import execution

    if registry.get_local_tool(READ_TOOL) is not None:
        raise BenchError("the no-op tools are already imported in this process; run the "
                         "round-trip count in a fresh process (python -m bench roundtrips)")
    phases: list[Phase] = []
    with ExitStack() as stack:
        setups: list[tuple[str, DexClient, Measure, dict[str, list[str]]]] = []
        for kind in stores:
            url = stack.enter_context(fresh_store(kind, postgres_url, workdir))
            publish_catalog(url)
            settings = DexSettings(redis_url=redis_server.url(DEX_DB), database_url=url)
            client = DexClient(settings, create_tables=False)
            stack.callback(client.close)
            measure = Measure(redis_server, [SqlCounter(client.store)])
            keys: dict[str, list[str]] = {}
            for path, tool in TOOLS.items():
                keys[path] = []
                phases.append(measure.run(kind, path, "call_tool (catalog)", calls, partial(
                    _send, client, f"rt-{kind}-{path}", tool, calls, keys[path])))
            setups.append((kind, client, measure, keys))

        __import__(TOOLS_MODULE)  # now the worker side can find the tools
        for kind, client, measure, keys in setups:
            rt = execution.runtime(client.app)
            worker_counter = SqlCounter(rt.store)
            worker_measure = Measure(redis_server, [worker_counter])
            task = StubTask(client.app)
            bodies: dict[str, Callable[[Any, str], None]] = {
                "read": execution.run_retrying, "single": execution.run_single_attempt}
            for path, tool in TOOLS.items():
                task.request.shadow = shadow_name(RUN_RETRYING, tool) if path == "read" else None
                phases.append(worker_measure.run(kind, path, "worker task body", calls, partial(
                    _work, bodies[path], task, keys[path])))
                phases.append(measure.run(kind, path, "wait (already terminal)", calls, partial(
                    _wait, client, keys[path])))
                phases.append(measure.run(kind, path, "call_tool (tool imported)", calls,
                                          partial(_send, client, f"rt-local-{kind}-{path}",
                                                  tool, calls, [])))
            worker_counter.remove()
            rt.store.close()
            rt.redis.close()
            execution.reset_runtime()
            for counter in measure.counters:
                counter.remove()
    return phases


def _run_variant(bench: Bench, variant: str, calls: int) -> None:
    bench.run(variant, calls, f"e2e-{variant}", lambda _: None)


def count_end_to_end(redis_server: RedisServer, kind: str, postgres_url: str | None, calls: int,
               workdir: Path) -> list[Phase]:
    """Redis commands per call with the real workers (raw Celery and both dex paths)."""
    phases: list[Phase] = []
    with fresh_store(kind, postgres_url, workdir) as url:
        bench = Bench(redis_server, url, workdir, "WARNING").start()
        try:
            for variant in ("raw", "read", "single"):
                bench.run(variant, 20, f"warm-{variant}", lambda _: None)
            measure = Measure(redis_server)
            for variant in ("raw", "read", "single"):
                phases.append(measure.run(kind, variant, "end to end (Redis only)", calls,
                                          partial(_run_variant, bench, variant, calls)))
        finally:
            bench.stop()
    return phases


def run_roundtrips(
    *,
    calls: int,
    stores: list[str],
    postgres_url: str | None,
    end_to_end: bool = True,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Count and print the round trips per call; write the results."""
    console = console or Console()
    redis_server = RedisServer().start()
    machine = machine_info(redis_server, postgres_url if "postgres" in stores else None)
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-rt-"))
    try:
        with console.status("counting round trips in this process"):
            phases = in_process(redis_server, stores, postgres_url, calls, workdir)
        if end_to_end:
            with console.status("counting Redis commands end to end"):
                phases += count_end_to_end(redis_server, stores[0], postgres_url, calls,
                                           workdir)
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [p.per_call() for p in phases]
    print_roundtrips(console, rows, calls)
    payload = {"config": {"calls": calls, "stores": stores, "end_to_end": end_to_end},
               "machine": machine,
               "phases": rows}
    return save_results("roundtrips", payload, out_dir, console)


def _fmt(counts: dict[str, float], keys: tuple[str, ...] = ()) -> str:
    items = [(k, counts[k]) for k in keys if k in counts] if keys else sorted(counts.items())
    return " ".join(f"{k}={v:g}" for k, v in items) or "-"


def print_roundtrips(console: Console, rows: list[dict[str, Any]], calls: int) -> None:
    table = Table(title=f"Round trips per call (averaged over {calls} calls)",
                  caption="sql: statements by verb, commit/rollback = transactions, connect = "
                          "new DB connections; redis: commands counted by the server")
    for column in ("store", "path", "phase", "ms/call", "stmts", "tx", "connect", "sql detail",
                   "redis"):
        table.add_column(column, justify="right" if column in ("ms/call", "stmts", "tx",
                                                                "connect") else "left")
    for r in rows:
        sql = r["sql"]
        tx = sql.get("commit", 0) + sql.get("rollback", 0)
        table.add_row(r["store"], r["path"], r["phase"], f"{r['ms_per_call']:.2f}",
                      f"{sql.get('statements', 0):g}", f"{tx:g}", f"{sql.get('connect', 0):g}",
                      _fmt(sql, ("SELECT", "INSERT", "UPDATE", "BEGIN", "commit", "rollback")),
                      _fmt(r["redis"]))
    console.print(table)
