"""JSON and ids in the store, on SQLite and PostgreSQL: jsonb columns, compared by value; JSON
null kept apart from SQL NULL; what jsonb cannot hold refused alike on both engines; event and
message ids past 32 bits."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.dialects.postgresql import psycopg

from dex_tasks import (
    CallStatus,
    ConflictError,
    DexClient,
    InvalidCallError,
    MessageRole,
    define_tool,
    registry,
)
from dex_tasks.store import Store
from dex_tasks.store.moves import single_statement
from dex_tasks.store.sqljson import JsonText, canonical_text, same_json, storable_json
from dex_tasks.store.transitions import Started
from tests.conftest import StartWorker, fast_settings


@pytest.fixture
def db_client(redis_url: str, database_url: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[DexClient]:
    """A client on each engine, with ``json_probe``: a read that takes any JSON object."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    define_tool("json_probe", {"type": "object"}, lambda ctx, arguments: arguments,
                effect="read")
    with DexClient(fast_settings(redis_url, database_url)) as client:
        yield client


def is_postgres(client: DexClient) -> bool:
    return client.store.engine.dialect.name == "postgresql"


def test_same_json_compares_values_as_json_does() -> None:
    assert same_json('{"a":1,"b":[1,2]}', '{"b": [1, 2], "a": 1}')
    assert same_json('{"n":1e+20}', '{"n":100000000000000000000}')  # jsonb's spelling
    assert same_json('{"n":1}', '{"n":1.0}')
    assert not same_json('{"n":1}', '{"n":true}')  # Python's True == 1 is not JSON's
    assert not same_json('{"n":0}', '{"n":false}')
    assert not same_json('{"a":[1,2]}', '{"a":[2,1]}')
    assert not same_json('{"a":1}', '{"a":1,"b":null}')
    assert not same_json('{"a":"1"}', '{"a":1}')


ARGUMENTS: dict[str, Any] = {
    "order_id": "1001", "big": 1e20, "ratio": 0.1, "flag": True, "none": None,
    "nested": {"z": [1, 2.5, "é"], "a": {}}, "emoji": "📦",
}


def test_json_columns_hold_values_and_repeats_compare_by_value(db_client: DexClient) -> None:
    # Given a call whose arguments jsonb spells differently from the canonical text
    first = db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                tool="json_probe", arguments=ARGUMENTS)
    # When the agent repeats it (keys in another order), it gets the same record back
    again = db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                tool="json_probe", arguments=dict(reversed(ARGUMENTS.items())))
    assert again.key == first.key and again.arguments == ARGUMENTS
    assert db_client.get_tool_call(first.key).arguments == ARGUMENTS
    # But other values for the same key are a conflict, true for 1 included
    for changed in ({**ARGUMENTS, "flag": 1}, {**ARGUMENTS, "ratio": 0.2},
                    {**ARGUMENTS, "extra": None}):
        with pytest.raises(ConflictError, match="arguments"):
            db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                tool="json_probe", arguments=changed)

    # And the column is JSON the database can look inside: jsonb on PostgreSQL
    with db_client.store.read() as conn:
        if is_postgres(db_client):
            kind, order = conn.execute(text(
                "SELECT jsonb_typeof(arguments), arguments->>'order_id' FROM dex_tool_calls"
            )).one()
            assert (kind, order) == ("object", "1001")
        else:
            assert conn.execute(text(
                "SELECT json_extract(arguments, '$.order_id') FROM dex_tool_calls"
            )).scalar_one() == "1001"
    types = {c["name"]: str(c["type"]) for c in
             inspect(db_client.store.engine).get_columns("dex_tool_calls")}
    expected = "JSONB" if is_postgres(db_client) else "TEXT"
    assert (types["arguments"], types["result"]) == (expected, expected)


def test_json_null_is_not_sql_null(db_client: DexClient) -> None:
    store = db_client.store
    record = db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                 tool="json_probe", arguments={"order_id": "1001"})
    assert store.get_call(record.key).result is None  # type: ignore[union-attr]
    # When a call's result is JSON null (a tool that returned None)
    assert store.transition(record.key, CallStatus.RUNNING)
    assert store.transition(record.key, CallStatus.SUCCEEDED, values={"result": "null"})
    # Then the text "null" comes back, in the call and in its tool message, on both engines
    assert store.get_call(record.key).result == "null"  # type: ignore[union-attr]
    tool = [m for m in db_client.get_agent_snapshot("s1").messages
            if m.role is MessageRole.TOOL]
    assert [m.tool_output for m in tool] == ["null"]


def test_what_jsonb_cannot_hold_is_refused_alike_on_both_engines(db_client: DexClient) -> None:
    for bad, what in (({"note": "a\x00b"}, r"arguments\.note contains a NUL"),
                      ({"a\x00": 1}, "a key of arguments contains a NUL"),
                      ({"note": ["ok", "\ud800"]}, r"arguments\.note\[1\] contains a lone")):
        with pytest.raises(InvalidCallError, match=what):
            db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                tool="json_probe", arguments=bad)
    assert db_client.get_agent_snapshot("s1").tool_calls == []

    # A diagnostic (an event's detail quoting a tool's message) is stored whatever it holds:
    # jsonb gets a replacement character rather than a transition that fails
    record = db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                 tool="json_probe", arguments={"order_id": "1001"})
    assert db_client.store.transition(record.key, CallStatus.RUNNING,
                                      detail={"error": "bad\x00byte \udc80"})
    error = db_client.store.events_for_call(record.key)[-1].detail
    quoted = json.loads(error or "")["error"]
    if is_postgres(db_client):
        assert quoted == "bad\ufffdbyte \ufffd"
    else:
        assert quoted == "bad\x00byte \udc80"


def test_storable_json_passes_plain_text_as_it_is_and_makes_the_rest_holdable() -> None:
    # ASCII text without a \u escape cannot spell a NUL or a lone surrogate: kept as it is
    plain = '{"b": [1, 2.5, null], "a": "x\\\\y"}'
    assert storable_json(plain) is plain
    # Escapes of a NUL or a lone surrogate, or a raw surrogate: U+FFFD, in canonical text
    assert storable_json('{"t": "a\\u0000b \\udc80"}') == '{"t":"a\\ufffdb \\ufffd"}'
    assert storable_json('{"t": "\u00e9 \udc80"}') == '{"t":"\\u00e9 \\ufffd"}'
    # A surrogate pair is one character, kept; JSON null stays JSON null
    assert json.loads(storable_json('["\\ud83d\\udce6"]')) == ["\U0001f4e6"]
    assert storable_json("null") == "null"
    # Text that is not JSON and must be parsed here is refused here
    with pytest.raises(ValueError):
        storable_json('"\\u00e9')


def test_a_single_statement_move_sends_its_json_as_text_for_the_server_to_cast() -> None:
    # Given PostgreSQL's one-statement form of a retrying call's ending that writes JSON
    # columns, with its start's event
    compiled = single_statement(
        CallStatus.SUCCEEDED, frozenset({CallStatus.QUEUED}), ("attempts",),
        ("arguments", "finished_at", "lease_expires_at", "result", "updated_at"),
        started=True).compile(dialect=psycopg.dialect())
    # Then its JSON values and event details are text the server casts to jsonb, not values
    # the column type parses here and psycopg writes out again
    for name in ("v_result", "v_arguments", "ev_detail", "st_detail"):
        assert re.search(rf"CAST\(%\({name}\)s(::VARCHAR)? AS JSONB\)", compiled.string), name
        assert not isinstance(compiled.binds[name].type, JsonText), name


def test_what_a_move_writes_as_json_is_stored_as_json_on_both_engines(
    db_client: DexClient,
) -> None:
    store = db_client.store

    def new_call(tool_call_id: str) -> str:
        return db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id=tool_call_id,
                                   tool="json_probe", arguments={"order_id": "1001"}).key

    def stored(key: str) -> tuple[str | None, list[str | None]]:
        return (store.get_call(key).result,  # type: ignore[union-attr]
                [e.detail for e in store.events_for_call(key)])

    # Given ordinary JSON: a result (canonical, as the store hands it back) and details, in
    # an ending that also writes its attempt's start (one statement on PostgreSQL)
    value = {"order_id": "1001", "items": [1, 2.5, "é", "📦", None], "ok": True, "n": {}}
    detail = {"reason": "done é", "n": [1, 2]}
    start = {"attempt": 1, "worker": "w:1"}
    plain = new_call("c1")
    assert store.transition(plain, CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                            values={"result": canonical_text(value)}, detail=detail,
                            started=Started(at=time.time(), detail=start))
    # Then they read back as written: the result's text exactly, the details by value (the
    # store hands back canonical text; SQLite keeps the text written)
    result, details = stored(plain)
    assert result == canonical_text(value)
    assert [json.loads(d) if d else d for d in details[1:]] == [start, detail]
    if is_postgres(db_client):
        assert details[1:] == [canonical_text(start), canonical_text(detail)]
    tool = [m for m in db_client.get_agent_snapshot("s1").messages if m.key == plain]
    assert [json.loads(m.tool_output or "") for m in tool] == [value]

    # Given diagnostics with a NUL and a lone surrogate (escaped, as json.dumps writes them)
    bad = "bad\x00byte \udc80"
    diagnostic = new_call("c2")
    assert store.transition(diagnostic, CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                            values={"result": json.dumps({"text": bad})},
                            detail={"error": bad},
                            started=Started(at=time.time(), detail={"worker": bad}))
    # Then the move still succeeds: jsonb holds U+FFFD in their place, SQLite the text
    result, details = stored(diagnostic)
    kept = "bad\ufffdbyte \ufffd" if is_postgres(db_client) else bad
    assert json.loads(result or "") == {"text": kept}
    assert [json.loads(d or "") for d in details[1:]] == [{"worker": kept}, {"error": kept}]
    if is_postgres(db_client):
        # And so is a lone surrogate in JSON text written without escapes (which SQLite
        # cannot encode)
        raw = new_call("c4")
        assert store.transition(raw, CallStatus.SUCCEEDED, allowed={CallStatus.QUEUED},
                                values={"result": json.dumps(["é \udc80"], ensure_ascii=False)})
        assert json.loads(stored(raw)[0] or "") == ["é \ufffd"]

    # And JSON null is stored as JSON null, a missing detail as SQL NULL
    null = new_call("c3")
    assert store.transition(null, CallStatus.RUNNING)
    assert store.transition(null, CallStatus.SUCCEEDED, values={"result": "null"})
    result, details = stored(null)
    assert (result, details[1:]) == ("null", [None, None])
    with store.read() as conn:
        kind = ("jsonb_typeof(result)" if is_postgres(db_client)
                else "json_type(result)")
        assert conn.execute(text(f"SELECT {kind}, result IS NULL FROM dex_tool_calls "
                                 "WHERE key = :key"), {"key": null}).one() == ("null", False)
        assert conn.execute(text("SELECT count(*) FROM dex_call_events WHERE key = :key "
                                 "AND detail IS NULL"), {"key": null}).scalar_one() == 2


def test_a_result_jsonb_cannot_hold_fails_the_call_saying_why(
    database_url: str, redis_url: str, start_worker: StartWorker,
) -> None:
    # Given a worker on this engine whose tool returns a text with a NUL in it
    settings = fast_settings(redis_url, database_url)
    start_worker(tools="tests.storage_tools",
                 extra_env={"DEX_DATABASE_URL": database_url})
    with DexClient(settings) as client:
        record = client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                  tool="nul_text", arguments={"before": "a", "after": "b"})
        # Then the call ends (it does not hang on a store error), failed, saying why
        done = client.wait(record.key, timeout=30)
    assert done.status is CallStatus.FAILED
    assert done.error == ("the tool ran but its result.text contains a NUL character (\\x00), "
                          "which the store cannot hold")


def test_event_and_message_ids_go_past_32_bits(db_client: DexClient) -> None:
    # Given ids already past what a 32-bit column holds
    past = 2**31 + 10
    with db_client.store.write() as conn:
        if is_postgres(db_client):
            for table in ("dex_call_events", "dex_messages"):
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                                  f"{past})"))
        else:
            # SQLite numbers a new row max(id) + 1: a placeholder row at the mark does it.
            now = time.time()
            conn.execute(text(
                "INSERT INTO dex_call_events (id, session_id, key, event, to_status, "
                f"created_at) VALUES ({past}, 'other', 'other/t/c', 'x', 'queued', {now})"))
            conn.execute(text(
                "INSERT INTO dex_messages (id, session_id, role, text, status, created_at) "
                f"VALUES ({past}, 'other', 'user', 'x', 'delivered', {now})"))
    # When calls and messages are written
    record = db_client.call_tool(session_id="s1", turn_id="t1", tool_call_id="c1",
                                 tool="json_probe", arguments={"order_id": "1001"})
    assert db_client.send_user_message("s1", "hello")
    # Then their ids are past 2**31 and read back, also as an event cursor
    events = db_client.events("s1", after=2**31)
    assert [e.key for e in events] == [record.key] and events[0].id > past
    messages = db_client.get_agent_snapshot("s1").messages
    assert [m.text for m in messages] == ["hello"] and messages[0].id > past


def test_store_fixture_is_at_head(database_url: str) -> None:
    # The store every other test uses is migrated, not created from the models.
    from dex_tasks.store import schema

    store = Store(database_url)
    try:
        store.create_all()
        assert schema.inspect_schema(store).state == "head"
    finally:
        store.close()
