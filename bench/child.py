"""``python -m bench child``: a worker child's part of a call, piece by piece, dex-tasks beside
the contract's floor (issue 29).

No worker, pool or delivery: this process runs the retrying task's body as a prefork child
runs it (the registered task's ``run``, ``execution.run_retrying``) on calls inserted into a
fresh store, and the floor's (``floor_tasks.floor_call``) on calls of the same kind, the two
alternating round by round. Each piece is timed by this process's CPU (``time.process_time``)
around the function that does it:

* ``read``: the call's read (``Store.get_call_columns``, or ``Store.get_call``; the floor's
  ``Floor.read``);
* ``lease``: the attempt's lease in Redis (``Runs.start``; the floor's ``SET``);
* ``ending``: the ending's store write, its after-commit hooks left out (``Store.transition``
  less the announcement; ``Floor.end``), and for dex-tasks two parts of it: its statements
  (``store.driver``'s ``run`` and ``run_many`` inside the ending) and its transaction's
  ``BEGIN`` and ``COMMIT`` (on SQLite sent on the DB-API connection, ``StoreBase``'s
  ``sqlite_begin`` and ``run_text``; elsewhere SQLAlchemy's ``Connection.begin`` and the
  dialect's ``do_commit``; none on PostgreSQL, whose ending is one statement in autocommit);
* ``announcement``: the Redis round trip after the commit (``EndedNotifier``, its signed record
  included; the floor's ``DEL`` and ``PUBLISH`` pipeline);
* ``the rest``: everything else in the body (the checks, the tool, the Python around the
  pieces), and ``whole``: the body.

On SQLite the database's own work runs in this process and is counted; on PostgreSQL it runs
in the server and is not. A child in a live worker, sharing the machine's caches with the
other processes, costs more than one warm in a loop here: these figures are the pieces' sizes
relative to each other and to the floor's, not a live child's CPU.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import redis
from celery import Task
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import Connection
from sqlalchemy.engine.default import DefaultDialect

import bench.noop_tools  # noqa: F401 - registers the no-op tools in this process
from bench import floor_tasks
from bench.driver import call_row
from bench.infra import READ_TOOL, BenchError, bench_session, fresh_store, median, save_results
from dex_tasks import DexSettings
from dex_tasks.broker.announce import EndedNotifier
from dex_tasks.broker.celery_app import RUN_RETRYING, create_app, shadow_name
from dex_tasks.broker.runs import PendingStart, Runs
from dex_tasks.store import Store, base, driver
from dex_tasks.worker.main_process import register_tasks
from dex_tasks.worker.runtime import runtime

PIECES = ("read", "lease", "ending", "announcement", "the rest", "whole")
# Parts of dex-tasks' ending, timed only inside it.
ENDING_PARTS = ("ending: its statements", "ending: its BEGIN and COMMIT")
VARIANTS = ("dex-tasks", "floor")
# What sends a store write's BEGIN and COMMIT: SQLAlchemy's transaction, or on SQLite the
# DB-API connection (``StoreBase``'s ``sqlite_begin`` and ``run_text``).
TRANSACTION_CALLS = ((Connection, "begin"), (DefaultDialect, "do_commit"),
                     (base, "sqlite_begin"), (base, "run_text"))
DEX_DB = 1
OWNER_HOST = "bench-child@host"


class Clock:
    """CPU seconds spent in the functions :meth:`timing` wraps, by piece: the process's
    (``time.process_time``, every thread), or ``clock``'s (``time.thread_time``: the timing
    thread's alone, leaving out what a background thread does meanwhile)."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.spent: dict[str, float] = {}
        self._running: list[str] = []  # the pieces being timed now, outermost first

    @contextmanager
    def timing(self, targets: Sequence[tuple[Any, ...]]) -> Iterator[None]:
        """Wrap each ``(owner, attribute, piece)`` for the ``with`` block; a fourth item
        names a piece the call is timed inside of only (its other calls are not timed)."""
        with ExitStack() as stack:
            for owner, name, piece, *inside in targets:
                # patch.object puts each back as it was (an inherited one is deleted again).
                timed = self._timed(getattr(owner, name), piece, inside[0] if inside else None)
                stack.enter_context(mock.patch.object(owner, name, timed))
            yield

    def _timed(self, fn: Callable[..., Any], piece: str,
               inside: str | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # A piece timed inside itself (a wrapped function calling another of its piece)
            # counts once.
            if (inside is not None and inside not in self._running) or piece in self._running:
                return fn(*args, **kwargs)
            self._running.append(piece)
            started = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[piece] = self.spent.get(piece, 0.0) + self.clock() - started
                self._running.pop()
        return timed


def _calls(store: Store, count: int) -> list[str]:
    """``count`` new queued calls of the no-op read tool, over 20 sessions."""
    keys = []
    for i in range(count):
        key = f"s{i % 20}/t/{uuid.uuid4().hex[:12]}"
        row = call_row(key, time.time())
        row.update(tool=READ_TOOL, arguments="{}")
        store.insert_call(row)
        keys.append(key)
    return keys


def _dex_round(task: Task, keys: Sequence[str]) -> dict[str, float]:
    clock = Clock()
    statements, transaction = ENDING_PARTS
    # A live delivery names its tool (the shadow name), so its attempt's start is sent before
    # the read and its reply read after (``claiming.claim_leased``): both count as the lease.
    targets = [(Store, "get_call", "read"), (Store, "get_call_columns", "read"),
               (Runs, "start", "lease"),
               (Runs, "start_later", "lease"), (PendingStart, "number", "lease"),
               (Store, "transition", "ending"), (EndedNotifier, "__call__", "announcement"),
               (driver, "run", statements, "ending"), (driver, "run_many", statements, "ending"),
               *((owner, name, transaction, "ending") for owner, name in TRANSACTION_CALLS)]
    whole = 0.0
    with clock.timing(targets):
        for key in keys:
            # The request a worker's trace pushes around the body (not timed: the floor's
            # task has one too, and its call here is timed without).
            task.push_request(hostname=OWNER_HOST, id=str(uuid.uuid4()), retries=0,
                              delivery_info={}, shadow=shadow_name(RUN_RETRYING, READ_TOOL))
            try:
                started = time.process_time()
                task.run(key)
                whole += time.process_time() - started
            finally:
                task.pop_request()
    spent = clock.spent
    # The announcement runs inside the transition (its after-commit hook).
    spent["ending"] = spent.get("ending", 0.0) - spent.get("announcement", 0.0)
    return {**_per_call(spent, whole, len(keys)),
            **{part: spent.get(part, 0.0) / len(keys) for part in ENDING_PARTS}}


def _floor_round(keys: Sequence[str]) -> dict[str, float]:
    clock = Clock()
    targets = [(floor_tasks.Floor, "read", "read"), (redis.Redis, "set", "lease"),
               (floor_tasks.Floor, "end", "ending"),
               (redis.client.Pipeline, "execute", "announcement")]
    started = time.process_time()
    with clock.timing(targets):
        for key in keys:
            floor_tasks.floor_call(key)
    return _per_call(clock.spent, time.process_time() - started, len(keys))


def _per_call(spent: dict[str, float], whole: float, calls: int) -> dict[str, float]:
    pieces = {p: spent.get(p, 0.0) for p in PIECES[:4]}
    pieces["the rest"] = whole - sum(pieces.values())
    pieces["whole"] = whole
    return {p: seconds / calls for p, seconds in pieces.items()}


def _measure(url: str, redis_url: str, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    settings = DexSettings(redis_url=redis_url, database_url=url)
    store = Store(url)
    store.create_all()
    app = create_app(settings)
    register_tasks(app)
    task = app.tasks[RUN_RETRYING]
    floor_env = {"BENCH_FLOOR_DATABASE": url, "BENCH_FLOOR_BROKER": redis_url}
    saved = {name: os.environ.get(name) for name in floor_env}
    os.environ.update(floor_env)
    floor_tasks.forget_child()
    seen: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    try:
        _dex_round(task, _calls(store, 100))  # warm: connections, scripts, statements
        _floor_round(_calls(store, 100))
        for r in range(rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                keys = _calls(store, calls)
                measured = (_dex_round(task, keys) if variant == "dex-tasks"
                            else _floor_round(keys))
                for piece, seconds in measured.items():
                    seen[variant].setdefault(piece, []).append(seconds)
                ended = [store.get_call(k) for k in keys[-5:]]
                if not all(c is not None and c.status == "succeeded" for c in ended):
                    raise BenchError(f"{variant}: the calls did not succeed")
    finally:
        floor_tasks.forget_child()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # The body ran on this process's worker runtime, made for this app on first use.
        rt = runtime(app)
        rt.store.close()
        rt.redis.close()
        store.close()
        app.close()
    return {v: {p: round(median(s) * 1e6, 1) for p, s in ps.items()} for v, ps in seen.items()}


def run_child(*, calls: int, rounds: int, stores: Sequence[str], postgres_url: str | None,
              out_dir: Path | None, console: Console) -> dict[str, Any]:
    """Run every store's rounds, print the table, save the results."""
    results: dict[str, Any] = {"calls": calls, "rounds": rounds, "stores": {}}
    table = Table(title="A worker child's part of a call, CPU of this process per call, µs "
                        "(median of the rounds)")
    for column in ("store", "piece", *VARIANTS, "difference"):
        table.add_column(column, justify="left" if column in ("store", "piece") else "right")
    with bench_session("child", stores, postgres_url) as (redis_server, machine, workdir):
        results["machine"] = machine
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url:
                figures = _measure(url, redis_server.url(DEX_DB), calls, rounds)
            results["stores"][kind] = figures
            for piece in PIECES:
                dex, floor = figures["dex-tasks"][piece], figures["floor"][piece]
                table.add_row(kind, piece, f"{dex:,.0f}", f"{floor:,.0f}", f"{dex - floor:+,.0f}")
                if piece == "ending":
                    for part in ENDING_PARTS:
                        table.add_row(kind, f"  {part.removeprefix('ending: ')}",
                                      f"{figures['dex-tasks'][part]:,.0f}", "", "")
    console.print(table)
    console.print("On PostgreSQL the database server's CPU is not in these figures.")
    return save_results("child", results, out_dir, console)
