"""What a transaction pooler costs a call's store writes (issue 30, item 1).

One call's writes as an agent and a worker make them (``call_tool``'s insert, the claim, the
finish) on one fresh PostgreSQL database, three ways, interleaved round by round:

- ``direct``: straight to the server, as without a pooler (psycopg prepares the hot
  statements on the server after their second run on a connection);
- ``direct_unprepared``: straight to the server with ``DEX_STORE_POOLER=transaction``'s
  settings, which prepare nothing: what giving up prepared statements costs alone;
- ``pgbouncer``: through Debian's PgBouncer in transaction mode (``tests/pgbouncer.py``) with
  ``DEX_STORE_POOLER=transaction``: what an operator who puts the pooler in front pays.

Wall time per call and this process's CPU time per call, the median of the rounds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.driver import OWNER, call_row
from bench.infra import BenchError, bench_session, fresh_store, median, save_results
from dex_tasks.states import CallStatus
from dex_tasks.store import Store
from tests.pgbouncer import PgBouncer, pgbouncer_binary

VARIANTS = ("direct", "direct_unprepared", "pgbouncer")


def _one_call(store: Store, key: str) -> None:
    store.insert_call(call_row(key, time.time()))
    if store.claim(key, OWNER, 30.0, lambda row: None) is None:
        raise BenchError(f"the claim of {key} matched nothing")
    if not store.transition(key, CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                            match={"worker": OWNER}, values={"result": "1"}):
        raise BenchError(f"the finish of {key} matched nothing")


def time_variants(url: str, bouncer: PgBouncer, calls: int,
                  rounds: int) -> list[dict[str, Any]]:
    """Every variant on the database at ``url``, interleaved; one row per variant."""
    stores = {"direct": Store(url, pooler=False),
              "direct_unprepared": Store(url, pooler=True),
              "pgbouncer": Store(bouncer.url(url), pooler=True)}
    stores["direct"].create_all()
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for rnd in range(rounds + 1):  # round 0 warms the pools (and the prepared statements)
            for name in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
                store = stores[name]
                started, started_cpu = time.perf_counter(), time.process_time()
                for i in range(calls):
                    _one_call(store, f"{name}{rnd}/t/c{i}")
                if rnd:
                    wall[name].append((time.perf_counter() - started) / calls)
                    cpu[name].append((time.process_time() - started_cpu) / calls)
    finally:
        for store in stores.values():
            store.close()
    return [{"variant": name, "ms_per_call": round(median(wall[name]) * 1000, 3),
             "cpu_us_per_call": round(median(cpu[name]) * 1e6, 1),
             "rounds_ms": [round(t * 1000, 3) for t in wall[name]]} for name in VARIANTS]


def run_pooler(*, calls: int, rounds: int, postgres_url: str | None,
               out_dir: Path | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the three variants and print them with the command that made them."""
    console = console or Console()
    if pgbouncer_binary() is None:
        raise BenchError("pgbouncer is not installed (apt-get install pgbouncer)")
    command = f"python -m bench pooler --calls {calls} --rounds {rounds}"
    with bench_session("pooler", ["postgres"], postgres_url) as (_redis, machine, workdir), \
            fresh_store("postgres", postgres_url, workdir) as url:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        bouncer = PgBouncer(server=f"{parsed.host}:{parsed.port or 5432}").start()
        try:
            rows = time_variants(url, bouncer, calls, rounds)
        finally:
            bouncer.cleanup()
    table = Table(title=f"a call's store writes (insert, claim, finish): {command}")
    for column in ("variant", "ms per call", "CPU µs per call", "rounds (ms)"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["variant"], f"{row['ms_per_call']:.3f}", f"{row['cpu_us_per_call']:.0f}",
                      " ".join(f"{t:.3f}" for t in row["rounds_ms"]))
    console.print(table)
    console.print(f"load average before/after: {machine.get('loadavg')} / "
                  f"{machine.get('loadavg_after')}")
    return save_results("pooler", {"command": command, "machine": machine, "rows": rows},
                        out_dir, console)
