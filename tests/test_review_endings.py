"""Issue 19, finding 2: an ending the store cannot hold ends the call ``failed`` at once, and the
tool runs once.

Before, the terminal write raised: the call stayed ``running`` for a lease, then the reaper ran
a read again (and again) or ended a write ``outcome_unknown`` with a false "worker lost". No
beat runs here: only the worker can end these calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.limits import text_problem
from dex_tasks.worker import endings
from dex_tasks.worker.execution import Runtime
from tests.conftest import StartWorker, fast_settings
from workers import example_tools, ledger

assert example_tools.lookup_order.name == "lookup_order"  # registered in this process

CASES: list[tuple[str, dict[str, Any], str]] = [
    ("nul_error", {}, "ValueError: bad\ufffdbyte from the backend"),
    ("surrogate_error", {}, "ValueError: bad \ufffd text from the backend"),
    ("deep_result", {"depth": 5000}, "the tool ran but its result is nested deeper than"),
    ("unprintable_error", {}, "Unprintable (its message could not be read: RuntimeError)"),
]


def test_endings_the_store_cannot_hold_end_the_call_failed_at_once(
    database_url: str, redis_url: str, start_worker: StartWorker, ledger_path: Path
) -> None:
    # Given a worker on this engine (no beat: nothing else ends a call)
    start_worker(tools="tests.review_tools", extra_env={"DEX_DATABASE_URL": database_url})
    with DexClient(fast_settings(redis_url, database_url)) as client:
        # When tools end with a NUL or a lone surrogate in their error, a result nested too
        # deep, an exception whose __str__ raises
        records = {tool: client.call_tool(session_id="s", turn_id="t", tool_call_id=tool,
                                          tool=tool, arguments=arguments)
                   for tool, arguments, _ in CASES}
        # Then each ends failed at once, saying why in a text the store holds
        for tool, _, expected in CASES:
            final = client.wait(records[tool].key, timeout=15)
            assert final.status is CallStatus.FAILED, (tool, final)
            assert (final.error or "").startswith(expected), (tool, final.error)
            assert text_problem(final.error or "") is None
            assert final.attempts == 1
        # And its tool message carries the same text
        outputs = {m.tool: m.tool_output for m in client.get_agent_snapshot("s").messages
                   if m.tool}
        assert outputs == {tool: client.get_tool_call(r.key).error for tool, r in records.items()}
    # And each tool ran exactly once
    assert ledger.executions(ledger_path) == {r.key: 1 for r in records.values()}




@contextmanager
def _running_call(settings: DexSettings) -> Iterator[tuple[DexClient, Runtime, str]]:
    """A client, a worker's runtime on its store, and the key of a call claimed by ``w:1``."""
    with DexClient(settings) as client:
        record = client.call_tool(session_id="s", turn_id="t", tool_call_id="c",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        assert client.store.claim(record.key, "w:1", 30, lambda row: None) is not None
        rt = Runtime(settings=settings, store=client.store,
                     redis=redis.Redis.from_url(settings.redis_url), app=client.app)
        try:
            yield client, rt, record.key
        finally:
            rt.redis.close()


def test_a_terminal_write_the_store_refuses_for_its_data_ends_the_call_failed(
    database_url: str, redis_url: str
) -> None:
    # Given a running call, and an ending that slipped past the checks (a lone surrogate
    # written straight in: neither engine can encode it)
    with _running_call(fast_settings(redis_url, database_url)) as (client, rt, key):
        # When the worker records it (the body's own write, not reachable from a tool)
        won = endings.finish(rt, key, "w:1", CallStatus.FAILED, error="bad \udc80",
                             reason="tool_error")
        # Then the call ends failed at once, saying the store refused its ending
        assert won
        final = client.get_tool_call(key)
        assert final.status is CallStatus.FAILED
        assert final.error == ("the tool ended (failed) but the store refused to record that "
                               "ending (UnicodeEncodeError)")


@pytest.mark.parametrize("result", [
    "{not json",  # sent as it is, refused by the server (DataError)
    '"\\u00e9',  # parsed here first (it has an escape), refused here (ValueError)
])
def test_an_ending_whose_result_postgres_refuses_ends_the_call_failed(
    postgres_url: str, redis_url: str, result: str,
) -> None:
    # Given a running call on PostgreSQL, and an ending whose result is not JSON (written
    # straight in: a tool's result is dumped by the worker, never given as text)
    with _running_call(fast_settings(redis_url, postgres_url)) as (client, rt, key):
        # When the worker records it
        won = endings.finish(rt, key, "w:1", CallStatus.SUCCEEDED, result=result)
        # Then the call ends failed at once, saying the store refused its ending
        assert won
        final = client.get_tool_call(key)
        assert final.status is CallStatus.FAILED and final.result is None
        assert (final.error or "").startswith(
            "the tool ended (succeeded) but the store refused to record that ending (")
        tool = [m for m in client.get_agent_snapshot("s").messages if m.tool]
        assert [m.tool_output for m in tool] == [final.error]
