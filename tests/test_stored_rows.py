"""A call row read from the store is built without validating it again (``models.stored_call``,
issue 29): on both engines it must equal, field by field and type by type, what SQLModel's
validation builds from the same row; a row that lacks a column is still validated."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from dex_tasks import DexClient, DexSettings
from dex_tasks.store import CALLS
from dex_tasks.store.models import ToolCallRow, stored_call
from tests.conftest import fast_settings


@pytest.fixture
def settings(redis_url: str, database_url: str) -> DexSettings:
    return fast_settings(redis_url, database_url)


def _row(key: str, **values: object) -> dict[str, object]:
    now = time.time()
    row: dict[str, object] = {
        "key": key, "session_id": "s", "turn_id": "t", "tool_call_id": key.rsplit("/", 1)[-1],
        "tool": "lookup_order", "arguments": '{"order_id": "1"}', "effect": "read",
        "requires_approval": False, "max_attempts": 3, "status": "queued", "attempts": 0,
        "published_at": now, "created_at": now, "updated_at": now}
    row.update(values)
    return row


def test_a_stored_call_is_what_validation_would_build(client: DexClient) -> None:
    # Given calls stored with every kind of column filled or left empty: a bool either way,
    # whole-number floats (which SQLite may hand back as ints), JSON text, nulls
    rows = [
        _row("s/t/plain"),
        _row("s/t/full", requires_approval=True, time_limit=5, expires_at=time.time() + 60,
             original_arguments='{"order_id": "2"}', approval_rule='{"rule": "x"}',
             trace_context="00-" + "a" * 32 + "-" + "b" * 16 + "-01", status="succeeded",
             result='{"ok": true}', attempts=2, worker="node:1", finished_at=1e9,
             interrupt_id="i-1", error="Boom: x"),
    ]
    with client.store.engine.begin() as conn:
        for row in rows:
            conn.execute(CALLS.insert().values(**row))

    for row in rows:
        # When each is read as a worker reads it
        columns = client.store.get_call_columns(str(row["key"]))
        assert columns is not None
        fast, validated = stored_call(columns), ToolCallRow.model_validate(columns)

        # Then it is the validated row, value and type
        for name in ToolCallRow.model_fields:
            got, want = getattr(fast, name), getattr(validated, name)
            assert (got, type(got)) == (want, type(want)), name
        assert client.store.get_call(str(row["key"])) == validated

    # And a row that lacks a column is validated, and refused
    partial = dict(client.store.get_call_columns("s/t/plain") or {})
    del partial["status"]
    with pytest.raises(ValidationError, match="status"):
        stored_call(partial)
