"""``python -m bench producer``: the producer's part of a call, piece by piece, dex-tasks beside
the contract's floor (issue 29).

No worker: this process makes calls one at a time, ``DexClient.call_tool`` and the floor's
``call_tool`` (``Floor.insert`` of the call's row and first event, then Celery's
``apply_async``, as ``python -m bench floor`` sends them), the two alternating round by round.
The calls of a round are then ended in the store (untimed) and waited for one by one, each
ended at the waiter's first read: ``DexClient.wait`` beside the floor's ``Waiter.wait``.
Each piece is timed by this thread's CPU (``time.thread_time``) around the function that does
it.

``call_tool``'s pieces:

* ``checks``: the ids, the tool's name, the arguments' canonical JSON and the options
  (``agent.calls``'s ``idempotency_key``, ``check_tool_name``, ``checked_arguments``,
  ``request_options`` and ``policy.seconds``); the floor has none;
* ``catalog``: the tool's catalog entry (``DexClient._lookup``, cached);
* ``new row``: the policy and the row (``agent.calls.new_call``), and three parts of it: the
  arguments normalized (``ToolInfo.normalize`` and their canonical JSON), the policy
  (``resolve_policy`` and the approval rule) and tracing's hook (``tracing.request_span``);
* ``insert``: the store write (``Store.insert_call``; the floor's ``Floor.insert``), and two
  parts of dex-tasks': its statements (``store.driver``'s ``run``) and its transaction's
  ``BEGIN`` and ``COMMIT`` (none on PostgreSQL, whose insert is one statement in autocommit);
* ``publish``: the Celery message sent (``celery_app.publish``; the floor's ``apply_async``),
  and two parts of both: the message built (Celery's ``amqp.create_task_message``) and the
  Redis command (redis-py's ``Redis.execute_command``, the ``LPUSH``);
* ``publish mark``: the call marked sent (``Store.mark_sent``, which hands the mark to a
  thread that writes them in batches);
* ``record``: the record returned (``ToolCallRecord.from_row`` or ``from_mapping``);
* ``the rest``: everything else in ``call_tool`` (the Python around the pieces), ``whole``:
  this thread's CPU over the round, ``background``: the other threads' (the publish marks'
  writes, flushed at the end of the round), and ``process``: the two together.

``wait``'s pieces (a call ended before the wait): ``read`` (``Store.get_call_columns``; the
floor's ``Floor.read``), ``record`` (``ToolCallRecord.from_mapping``), ``the rest`` and
``whole``.

Each round of a variant runs twice, once untimed and once timed: the timing wrappers cost a
microsecond or two per piece, more for dex-tasks (more pieces) than for the floor, so the
figures to compare are the untimed rounds' (``untimed: call_tool``, this thread's CPU per call;
``untimed: background``, the other threads'; ``untimed: wait``), and the timed rounds' pieces
say where the time goes. On SQLite the database's own work runs in this process and is
counted; on PostgreSQL it runs in the server and is not.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from rich.console import Console
from rich.table import Table

from bench import floor_tasks
from bench.child import TRANSACTION_CALLS, Clock
from bench.infra import READ_TOOL, BenchError, bench_session, fresh_store, median, save_results
from bench.roundtrips import publish_catalog
from dex_tasks import DexClient, DexSettings, tracing
from dex_tasks.agent import calls as agent_calls
from dex_tasks.agent import client as agent_client
from dex_tasks.policy import ToolPolicy
from dex_tasks.store import Store, driver
from dex_tasks.store.catalog import ToolInfo
from dex_tasks.store.records import ToolCallRecord

PIECES = ("checks", "catalog", "new row", "insert", "publish", "publish mark", "record",
          "the rest", "whole", "background", "process")
# Parts of a piece, timed only inside it (and counted in it): (part, the piece).
PARTS = (("new row: arguments normalized", "new row"), ("new row: policy", "new row"),
         ("new row: tracing", "new row"), ("insert: its statements", "insert"),
         ("insert: its BEGIN and COMMIT", "insert"), ("publish: the message built", "publish"),
         ("publish: the Redis command", "publish"))
WAIT_PIECES = ("read", "record", "the rest", "whole")
# The wholes of rounds run with no timing wrapper: the figures to compare.
UNTIMED = ("untimed: call_tool", "untimed: background", "untimed: wait")
VARIANTS = ("dex-tasks", "floor")
DEX_DB, FLOOR_DB = 1, 2
CHECKS = ("idempotency_key", "check_tool_name", "checked_arguments", "request_options",
          "seconds")


class _Side:
    """One variant's producer: how it makes a call, and what its pieces are."""

    def __init__(self, name: str, client: DexClient, floor: floor_tasks.Floor,
                 floor_app: Celery, waiter: floor_tasks.Waiter) -> None:
        self.name = name
        self.client = client
        self.floor = floor
        self.floor_task = floor_app.tasks[floor_tasks.TASK]
        self.floor_app = floor_app
        self.waiter = waiter

    def call(self, session_id: str, tool_call_id: str) -> str:
        if self.name == "dex-tasks":
            return self.client.call_tool(session_id=session_id, turn_id="t",
                                         tool_call_id=tool_call_id, tool=READ_TOOL).key
        key = f"{session_id}/t/{tool_call_id}"
        self.floor.insert(key, session_id, "t", tool_call_id, READ_TOOL)
        self.floor_task.apply_async(args=[key])
        return key

    def wait(self, key: str) -> None:
        ended: str | None
        if self.name == "dex-tasks":
            ended = self.client.wait(key, timeout=10).status.value
        else:
            self.waiter.wait(self.floor, key, 10, read=True)
            ended = self.floor.read(key)
        if ended != "succeeded":
            raise BenchError(f"{self.name}: call {key} read as {ended}, not succeeded")

    def call_targets(self) -> list[tuple[Any, ...]]:
        """What ``call`` is timed around: ``(owner, attribute, piece[, inside])``."""
        if self.name == "floor":
            amqp = self.floor_app.amqp
            return [(floor_tasks.Floor, "insert", "insert"),
                    (self.floor_task, "apply_async", "publish"),
                    (amqp, "create_task_message", PARTS[5][0], "publish"),
                    (redis.Redis, "execute_command", PARTS[6][0], "publish")]
        return [
            *((agent_client, name, "checks") for name in CHECKS),
            (DexClient, "_lookup", "catalog"),
            (agent_client, "new_call", "new row"),
            (ToolInfo, "normalize", PARTS[0][0], "new row"),
            (agent_calls, "canonical_json", PARTS[0][0], "new row"),
            (agent_calls, "resolve_policy", PARTS[1][0], "new row"),
            (ToolPolicy, "approval_for", PARTS[1][0], "new row"),
            (tracing, "request_span", PARTS[2][0], "new row"),
            (Store, "insert_call", "insert"),
            (driver, "run", PARTS[3][0], "insert"),
            *((owner, name, PARTS[4][0], "insert") for owner, name in TRANSACTION_CALLS),
            (agent_client, "publish", "publish"),
            (*_message_built(self.client.app), PARTS[5][0], "publish"),
            (redis.Redis, "execute_command", PARTS[6][0], "publish"),
            (Store, "mark_sent", "publish mark"),
            (ToolCallRecord, "from_row", "record"),
            (ToolCallRecord, "from_mapping", "record"),
        ]

    def wait_targets(self) -> list[tuple[Any, ...]]:
        if self.name == "floor":
            return [(floor_tasks.Floor, "read", "read")]
        return [(Store, "get_call_columns", "read"), (ToolCallRecord, "from_mapping", "record")]

    def flush(self) -> None:
        """The background work a round left (the publish marks), done before its end."""
        if self.name == "dex-tasks":
            self.client.store.flush_publish_marks()


def _message_built(app: Celery) -> tuple[Any, str]:
    """Where the client's publish finds Celery's ``create_task_message``: what the app read
    of it at its first publish (``celery_app._sending``; the client has published by then,
    see :func:`_measure`), or ``app.amqp``'s own for a tree that reads it there each time."""
    sending = getattr(app, "dex_sending", None)
    return (sending, "create_message") if sending is not None else (
        app.amqp, "create_task_message")


def _round(side: _Side, tag: str, calls: int, *, timed: bool) -> dict[str, float]:
    """One round of ``side``: ``calls`` calls made, ended, then waited for; CPU µs per call,
    by piece when ``timed`` (else the wholes alone, with no timing wrapper in the way)."""
    clock = Clock(time.thread_time)
    keys = []
    with ExitStack() as stack:
        if timed:
            stack.enter_context(clock.timing(side.call_targets()))
        thread0, process0 = time.thread_time(), time.process_time()
        for i in range(calls):
            keys.append(side.call(f"{tag}-{i // 10}", f"c{i}"))
        side.flush()
        thread, process = time.thread_time() - thread0, time.process_time() - process0
    # Ended as a worker would end them (the floor's ending, on the same tables): each is
    # ended by the waiter's first read.
    for key in keys:
        side.floor.end(key, "bench-producer", time.time())
    waits = Clock(time.thread_time)
    with ExitStack() as stack:
        if timed:
            stack.enter_context(waits.timing(side.wait_targets()))
        started = time.thread_time()
        for key in keys:
            side.wait(key)
        wait = time.thread_time() - started
    if not timed:
        return {"untimed: call_tool": thread / calls, "untimed: background": (
            max(0.0, process - thread) / calls), "untimed: wait": wait / calls}
    pieces = {p: clock.spent.get(p, 0.0) for p in PIECES[:7]}
    pieces["the rest"] = thread - sum(pieces.values())
    pieces.update({"whole": thread, "background": max(0.0, process - thread),
                   "process": process})
    pieces.update({part: clock.spent.get(part, 0.0) for part, _ in PARTS})
    wait_pieces = {p: waits.spent.get(p, 0.0) for p in WAIT_PIECES[:2]}
    wait_pieces["the rest"] = wait - sum(wait_pieces.values())
    wait_pieces["whole"] = wait
    return {**{p: s / calls for p, s in pieces.items()},
            **{f"wait: {p}": s / calls for p, s in wait_pieces.items()}}


def _measure(url: str, redis_url: str, floor_url: str, calls: int,
             rounds: int) -> dict[str, dict[str, float]]:
    publish_catalog(url)
    with ExitStack() as stack:
        client = DexClient(DexSettings(redis_url=redis_url, database_url=url),
                           create_tables=False)
        stack.callback(client.close)
        floor = floor_tasks.Floor(url)
        stack.callback(floor.close)
        floor_app = floor_tasks.create_app(floor_url)
        stack.callback(floor_app.close)
        waiter = floor_tasks.Waiter(floor_url)
        stack.callback(waiter.close)
        sides = {name: _Side(name, client, floor, floor_app, waiter) for name in VARIANTS}
        run = uuid.uuid4().hex[:6]
        # One call before any timing: the client's app, its deferred imports (publish among
        # them) and what its publish reads once are in place, so the real functions are
        # what gets wrapped and put back.
        sides["dex-tasks"].call(f"first-{run}", "c0")
        for name, side in sides.items():  # warm: connections, statements, the catalog
            _round(side, f"warm-{name}-{run}", 100, timed=True)
        seen: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
        for r in range(rounds):
            # Each variant's untimed round, then its timed one, the variants alternating.
            for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                for timed in (False, True):
                    measured = _round(sides[name], f"r{r}-{name}-{timed:d}-{run}", calls,
                                      timed=timed)
                    for piece, seconds in measured.items():
                        seen[name].setdefault(piece, []).append(seconds)
    return {v: {p: round(median(s) * 1e6, 1) for p, s in ps.items()} for v, ps in seen.items()}


def run_producer(*, calls: int, rounds: int, stores: Sequence[str], postgres_url: str | None,
                 out_dir: Path | None, console: Console) -> dict[str, Any]:
    """Run every store's rounds, print the table, save the results."""
    results: dict[str, Any] = {"calls": calls, "rounds": rounds, "stores": {}}
    table = Table(title="The producer's part of a call, CPU per call, µs (median of the rounds)")
    for column in ("store", "piece", *VARIANTS, "difference"):
        table.add_column(column, justify="left" if column in ("store", "piece") else "right")
    with bench_session("producer", stores, postgres_url) as (redis_server, machine, workdir):
        results["machine"] = machine
        for kind in stores:
            with fresh_store(kind, postgres_url, workdir) as url:
                figures = _measure(url, redis_server.url(DEX_DB), redis_server.url(FLOOR_DB),
                                   calls, rounds)
            results["stores"][kind] = figures
            _rows(table, kind, figures)
    console.print(table)
    console.print("CPU of this thread, but for background and process (every thread); on "
                  "PostgreSQL the database server's CPU is not in these figures.")
    return save_results("producer", results, out_dir, console)


def _rows(table: Table, kind: str, figures: dict[str, dict[str, float]]) -> None:
    dex, floor = figures["dex-tasks"], figures["floor"]
    parts: dict[str, list[str]] = {}
    for part, piece in PARTS:
        parts.setdefault(piece, []).append(part)
    shown: list[tuple[str, str]] = []
    for piece in PIECES:
        shown.append((piece, f"call_tool: {piece}"))
        shown += [(part, f"  {part.split(': ', 1)[1]}") for part in parts.get(piece, [])]
    shown += [(f"wait: {p}", f"wait: {p}") for p in WAIT_PIECES]
    shown += [(name, name) for name in UNTIMED]
    for name, label in shown:
        ours, theirs = dex[name], floor[name]
        table.add_row(kind, label, f"{ours:,.1f}", f"{theirs:,.1f}", f"{ours - theirs:+,.1f}")
