"""Issue 19, finding 15: ``expire_unserved`` reads index ranges, never every queued call.

Its read was ``status = 'queued' AND <overdue> AND tool NOT IN (served)``: every sweep walked
the whole queue (~150 ms at 500k queued on PostgreSQL) to find the few calls of unserved tools.
Now it finds the tools that have queued calls by a loose scan of the ``(status, tool, effect)``
index and reads only the unserved ones' calls. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from sqlalchemy import event, text

from dex_tasks import CallStatus, DexSettings
from dex_tasks.broker.celery_app import create_app
from dex_tasks.broker.routing import Presence, announcements_complete
from dex_tasks.store import CALLS, Store
from dex_tasks.worker.execution import Runtime
from dex_tasks.worker.sweeps import expire_unserved
from tests.conftest import fast_settings
from tests.helpers import wait_until

BACKLOG = 3000


def _row(key: str, tool: str, at: float) -> dict[str, Any]:
    session, turn, call = key.split("/")
    return {"key": key, "session_id": session, "turn_id": turn, "tool_call_id": call,
            "tool": tool, "arguments": "{}", "effect": "read", "requires_approval": False,
            "max_attempts": 3, "time_limit": None, "status": CallStatus.QUEUED.value,
            "attempts": 0, "published_at": at, "created_at": at, "updated_at": at}


@contextmanager
def _selects(engine: Any) -> Iterator[list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        # The reads of the calls (not the transition's own delivery check of the transcript)
        if statement.lstrip().upper().startswith(("SELECT", "WITH")) and \
                "FROM dex_tool_calls" in statement and "dex_messages" not in statement:
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", capture)


def test_expire_unserved_reads_only_the_unserved_tools_calls(
    redis_url: str, database_url: str
) -> None:
    settings: DexSettings = fast_settings(redis_url, database_url,
                                          worker_heartbeat_seconds=0.2)
    store = Store(database_url)
    store.create_all()
    client = redis.Redis.from_url(redis_url)
    try:
        # Given a backlog of a served tool, all past the queue deadline, and a few calls of
        # tools no live worker serves: two overdue, one not yet
        now = time.time()
        long_ago = now - settings.queue_deadline_seconds - 60
        rows = [_row(f"s/backlog/c{i}", "lookup_order", long_ago) for i in range(BACKLOG)]
        rows += [_row(f"s/gone/c{i}", "charge_card", long_ago) for i in range(2)]
        rows += [_row("s/gone/recent", "refund_payment", now)]
        with store.write() as conn:
            conn.execute(CALLS.insert(), rows)
            if not store.is_sqlite:
                conn.execute(text("ANALYZE"))
        Presence(client, "w@h", ["lookup_order"], "prefork", 1,
                 settings.worker_heartbeat_seconds).beat_once()
        wait_until(lambda: announcements_complete(client, settings.worker_heartbeat_seconds),
                   10, "Redis to be up longer than an announcement lasts")
        rt = Runtime(settings=settings, store=store, redis=client, app=create_app(settings))

        # When the sweep runs
        with _selects(store.read_engine) as seen:
            ended = expire_unserved(rt, now=now)

        # Then it ends the two overdue calls of the unserved tool, and nothing else
        assert ended == 2
        with store.read() as conn:
            statuses = dict(conn.execute(text(
                "SELECT status, count(*) FROM dex_tool_calls GROUP BY status")).all())
        assert statuses == {"queued": BACKLOG + 1, "failed": 2}

        # And each read is an index range (per tool), never a walk of the queued calls
        explain = "EXPLAIN QUERY PLAN" if store.is_sqlite else "EXPLAIN"
        with store.read() as conn:
            plans = ["\n".join(str(r[-1] if store.is_sqlite else r[0])
                               for r in conn.exec_driver_sql(f"{explain} {sql}", params))
                     for sql, params in seen]
        assert len(plans) == 2  # the tools with queued calls, then the unserved ones' calls
        for (sql, _), plan in zip(seen, plans, strict=True):
            assert "Seq Scan" not in plan and "SCAN dex_tool_calls" not in plan, plan
            if store.is_sqlite:
                # The loose scan: the first tool (min() reads one index entry), then each next
                assert ("(status=? AND tool>?)" if "queued_tools" in sql
                        else "(status=? AND tool=?)") in plan, plan
            else:
                conds = [line for line in plan.splitlines() if "Index Cond" in line]
                assert conds and all("tool" in line for line in conds), plan
    finally:
        client.close()
        store.close()
