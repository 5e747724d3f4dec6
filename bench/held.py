"""What a held connection saves per store operation (issue 29, the third round).

``python -m bench held`` runs, on a fresh store of each kind, the store operations a call
costs a worker child and a producer, one after another on one thread as they run there:
``insert_call`` (the producer), ``get_call`` (the child's read, and ``wait``'s) and the
ending of a leased attempt (``transition`` queued -> succeeded with its start, the child's
ending without the Redis announcement). Each runs N times per round on a store that keeps
each engine's last connection for the next transaction (``held``, the default) and on one
that checks a connection out of SQLAlchemy's pool for each (``pooled``,
``Store(hold_connections=False)``), the two alternating round by round. It prints the CPU
time of this process per operation (``time.process_time``; the database server's own CPU is
not in it, and is the same both ways).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.driver import call_row
from bench.infra import bench_session, fresh_store, median, save_results
from dex_tasks.states import CallStatus
from dex_tasks.store import Store
from dex_tasks.store.transitions import Started

OWNER = "bench@host:1"
OPERATIONS = ("insert_call", "get_call", "ending")
VARIANTS = ("held", "pooled")


def leased_ending(store: Store, key: str) -> None:
    """A leased attempt's ending, as ``endings.finish`` writes it for attempt 1."""
    assert store.transition(
        key, CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED}, match={"attempts": 0},
        values={"attempts": 1, "worker": OWNER, "result": "null"},
        started=Started(time.time(), {"attempt": 1, "worker": OWNER}))


def _timed(op: Callable[[str], Any], keys: Sequence[str]) -> float:
    """CPU seconds of this process per run of ``op``."""
    start = time.process_time()
    for key in keys:
        op(key)
    return (time.process_time() - start) / len(keys)


def _round(store: Store, calls: int) -> dict[str, float]:
    keys = [f"s{i % 20}/t/{uuid.uuid4().hex[:10]}" for i in range(calls)]
    return {"insert_call": _timed(lambda k: store.insert_call(call_row(k, time.time())), keys),
            "get_call": _timed(store.get_call, keys),
            "ending": _timed(lambda k: leased_ending(store, k), keys)}


def run_held(*, calls: int, rounds: int, stores: Sequence[str], postgres_url: str | None,
             out_dir: Path | None, console: Console) -> dict[str, Any]:
    """Run every store's rounds, print the table, save the results."""
    results: dict[str, Any] = {"calls": calls, "rounds": rounds, "stores": {}}
    table = Table(title="CPU per store operation, this process, µs (median of the rounds)")
    for column in ("store", "operation", "held", "pooled", "saved"):
        table.add_column(column, justify="left" if column in ("store", "operation") else "right")
    with bench_session("held", stores, postgres_url) as (_redis, machine, workdir):
        results["machine"] = machine
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url:
                built = {"held": Store(url), "pooled": Store(url, hold_connections=False)}
                try:
                    built["held"].create_all()
                    for variant in VARIANTS:  # warm both: pools filled, statements prepared
                        _round(built[variant], 50)
                    seen: dict[str, dict[str, list[float]]] = {
                        v: {op: [] for op in OPERATIONS} for v in VARIANTS}
                    for r in range(rounds):
                        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                            for op, seconds in _round(built[variant], calls).items():
                                seen[variant][op].append(seconds)
                finally:
                    for store in built.values():
                        store.close()
            results["stores"][kind] = {
                v: {op: round(median(s) * 1e6, 1) for op, s in ops.items()}
                for v, ops in seen.items()}
            for op in OPERATIONS:
                held = results["stores"][kind]["held"][op]
                pooled = results["stores"][kind]["pooled"][op]
                table.add_row(kind, op, f"{held:.0f}", f"{pooled:.0f}", f"{pooled - held:.0f}")
    console.print(table)
    return save_results("held", results, out_dir, console)
