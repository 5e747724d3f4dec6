"""What sending a call's publish while its insert is on the wire would save (issue 29, the fifth
round): the same insert and publish, one after the other and overlapped, on one connection and
one thread.

``python -m bench overlap`` (PostgreSQL only) runs ``call_tool``'s two waits as a producer meets
them: the insert of a call with its first event (one statement in autocommit, prepared once,
like the store's but without its conflict and tombstone checks) and the publish of its message
(Celery's ``send_task`` to a queue no worker consumes, on a private Redis). The **sequential**
variant sends the statement, waits for its reply, then publishes (``call_tool``'s order); the
**overlapped** one sends the statement with libpq's asynchronous calls (``PQsendQueryPrepared``,
``PQflush`` through psycopg's ``pgconn``), publishes while the server inserts and flushes its
WAL, then reads the reply. Both run the same statement on the same connection, alternating call
by call; it prints the p50 and p90 of the pair's wall time and this process's CPU per pair.

The fifth round built this into ``call_tool`` after a helper thread's hand-off had cost what
its overlap saved; inside ``call_tool`` the pair's saving shrank to about 0.1 ms and moved no
target, so ``call_tool`` still publishes after its insert (``docs/performance.md``).
"""

from __future__ import annotations

import select
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psycopg import pq
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine

from bench.driver import call_row
from bench.infra import BenchError, bench_session, fresh_store, median, percentile, save_results
from dex_tasks.broker.celery_app import create_app
from dex_tasks.settings import DexSettings
from dex_tasks.store import Store

VARIANTS = ("sequential", "overlapped")
QUEUE = "bench.overlap.nobody"
STATEMENT = b"dex_bench_overlap_insert"
# The call's row as the store inserts it: the columns the client gives, and the one it leaves
# to its Python default.
_DEFAULTS = {"republishes": 0}
_COLUMNS = (*call_row("s/t/c", 0.0), *_DEFAULTS)
# The call and its first event in one statement, as the store's PostgreSQL insert writes them.
_SQL = (
    "WITH new_call AS (INSERT INTO dex_tool_calls ({cols}) VALUES ({marks}) "
    "RETURNING key, session_id, status, created_at) "
    "INSERT INTO dex_call_events (session_id, key, event, from_status, to_status, detail, "
    "created_at) SELECT session_id, key, 'tool_call_requested', NULL, status, NULL, created_at "
    "FROM new_call"
).format(cols=", ".join(_COLUMNS),
         marks=", ".join(f"${i + 1}" for i in range(len(_COLUMNS))))


def _text(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format (its type left for the server to infer)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    return str(value).encode()


class Producer:
    """One connection and one Celery app: the insert and the publish of a call, both ways."""

    def __init__(self, url: str, redis_url: str) -> None:
        self.engine = create_engine(url, isolation_level="AUTOCOMMIT")
        self.conn = self.engine.raw_connection()
        driver = self.conn.driver_connection
        assert driver is not None
        self.pg: Any = driver.pgconn  # type: ignore[attr-defined]
        self._check(self.pg.prepare(STATEMENT, _SQL.encode()))
        self.app = create_app(DexSettings(redis_url=redis_url, database_url=url),
                              publisher=True)

    def _check(self, result: Any) -> None:
        if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            raise BenchError(f"the insert failed: {result.error_message.decode()}")

    def _send(self, key: str) -> None:
        row = {**call_row(key, time.time()), **_DEFAULTS}
        self.pg.send_query_prepared(STATEMENT, [_text(row[c]) for c in _COLUMNS])  # raises
        while self.pg.flush():
            select.select([], [self.pg.socket], [])

    def _reply(self) -> None:
        results = []
        while True:  # every result, so that the connection is idle again whatever they say
            self.pg.consume_input()
            while self.pg.is_busy():
                select.select([self.pg.socket], [], [])
                self.pg.consume_input()
            result = self.pg.get_result()
            if result is None:
                break
            results.append(result)
        for result in results:
            self._check(result)

    def _publish(self, key: str) -> None:
        self.app.send_task("bench.overlap.noop", args=[key], queue=QUEUE, declare=[],
                           retry=False)

    def sequential(self, key: str) -> None:
        self._send(key)
        self._reply()
        self._publish(key)

    def overlapped(self, key: str) -> None:
        self._send(key)
        self._publish(key)
        self._reply()

    def close(self) -> None:
        self.app.close()
        self.conn.close()
        self.engine.dispose()


def _timed(op: Callable[[str], None], key: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one run of ``op``."""
    cpu, wall = time.process_time(), time.perf_counter()
    op(key)
    return time.perf_counter() - wall, time.process_time() - cpu


def run_overlap(*, calls: int, rounds: int, postgres_url: str | None, out_dir: Path | None,
                console: Console) -> dict[str, Any]:
    """Run the rounds, print the table, save the results."""
    if not postgres_url:
        raise BenchError("the overlap benchmark needs PostgreSQL: --postgres-url or "
                         "DEX_TEST_POSTGRES_URL")
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with bench_session("overlap", ["postgres"], postgres_url) as (redis_server, machine,
                                                                  workdir):
        with fresh_store("postgres", postgres_url, workdir) as url:
            store = Store(url)
            try:
                store.create_all()
            finally:
                store.close()
            producer = Producer(url, redis_server.url(6))
            try:
                for rnd in range(rounds + 1):  # round 0 warms the connection and Redis
                    for i in range(calls):
                        order: Sequence[str] = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                        for variant in order:
                            seconds, used = _timed(getattr(producer, variant),
                                                   f"{variant}{rnd}/t/{uuid.uuid4().hex[:8]}")
                            if rnd:
                                wall[variant].append(seconds)
                                cpu[variant].append(used)
            finally:
                producer.close()
    results: dict[str, Any] = {"calls": calls, "rounds": rounds, "machine": machine,
                               "variants": {}}
    table = Table(title="call_tool's insert and publish on PostgreSQL, one after the other "
                        "and overlapped")
    for column in ("variant", "p50 ms", "p90 ms", "CPU per call µs"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for variant in VARIANTS:
        figures = {"p50_ms": round(median(wall[variant]) * 1e3, 3),
                   "p90_ms": round(percentile(wall[variant], 90) * 1e3, 3),
                   "cpu_us": round(sum(cpu[variant]) / len(cpu[variant]) * 1e6, 1)}
        results["variants"][variant] = figures
        table.add_row(variant, f"{figures['p50_ms']:.3f}", f"{figures['p90_ms']:.3f}",
                      f"{figures['cpu_us']:.0f}")
    console.print(table)
    return save_results("overlap", results, out_dir, console)
