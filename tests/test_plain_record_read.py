"""``get_tool_call`` builds its record from the row's columns as read, without a ``ToolCallRow``
in between (issue 29): the record must be the one the row-based path builds, field for field,
on both stores, for a call with every optional field set and for a fresh one."""

from __future__ import annotations

import time

from dex_tasks.states import CallStatus
from dex_tasks.store import Store
from dex_tasks.store.records import ToolCallRecord


def _row(key: str, now: float) -> dict[str, object]:
    session, turn, call_id = key.split("/")
    return {"key": key, "session_id": session, "turn_id": turn, "tool_call_id": call_id,
            "tool": "refund", "arguments": '{"amount_cents":20000}', "effect": "read",
            "requires_approval": True, "max_attempts": 3, "time_limit": None,
            "status": CallStatus.QUEUED.value, "attempts": 0, "published_at": now,
            "created_at": now, "updated_at": now,
            "original_arguments": '{"amount_cents":50000}',
            "approval_rule": '{"rule":"amount","required":true,"reason":"big"}'}


def test_the_record_from_the_columns_is_the_record_from_the_row(database_url: str) -> None:
    store = Store(database_url)
    store.create_all()
    try:
        # Given a call that ran and ended with a result, and one just requested
        store.insert_call(_row("s/t/ended", time.time()))
        store.insert_call(_row("s/t/fresh", time.time()))
        assert store.claim("s/t/ended", "w@h:1", 30.0, lambda row: None) is not None
        assert store.transition("s/t/ended", CallStatus.SUCCEEDED, allowed={CallStatus.RUNNING},
                                match={"worker": "w@h:1"}, values={"result": '{"ok":[1,2]}'})
        for key in ("s/t/ended", "s/t/fresh"):
            # When its record is built from the plain columns
            columns = store.get_call_columns(key)
            row = store.get_call(key)
            assert columns is not None and row is not None
            plain = ToolCallRecord.from_mapping(columns)
            # Then it is the record built from the ORM row
            assert plain == ToolCallRecord.from_row(row)
        ended = ToolCallRecord.from_mapping(store.get_call_columns("s/t/ended") or {})
        assert ended.status is CallStatus.SUCCEEDED and ended.result == {"ok": [1, 2]}
        assert ended.original_arguments == {"amount_cents": 50000}
        assert ended.approval_rule == {"rule": "amount", "required": True, "reason": "big"}
        assert ended.requires_approval is True and ended.finished_at is not None
        assert store.get_call_columns("s/t/missing") is None
    finally:
        store.close()
