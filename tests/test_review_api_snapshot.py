"""``GET /sessions/{id}/snapshot`` is paged: a session of 100k messages and 1500 calls is
served in bounded pieces, in bounded memory, and every message and call is reachable by its
cursors; ``get_agent_snapshot`` still returns the whole session (issue 19, finding 4: 100k
messages were one 34 MB answer of 4-11 s, and four at once took the API from 237 to 794 MB).
Rows are seeded in bulk through the store, on SQLite."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from dex_tasks import DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.store import CALLS, MESSAGES
from dex_tasks.tokens import issue_token
from workers import example_tools

assert example_tools.lookup_order  # registered here: call_tool validates locally

SESSION = "sess-big"
MESSAGES_COUNT = 100_000
CALLS_COUNT = 1500
MAX_CURSOR = 2**63 - 1


@pytest.fixture
def big_session(client: DexClient) -> None:
    first = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c0",
                             tool="lookup_order", arguments={"order_id": "1001"})
    with client.store.write() as conn:
        row = dict(conn.execute(select(CALLS).where(CALLS.c.key == first.key)).mappings().one())
        copies = []
        for i in range(1, CALLS_COUNT):
            copy = {**row, "key": f"{SESSION}/t1/c{i}", "tool_call_id": f"c{i}",
                    "created_at": row["created_at"] + i * 0.001}
            copy.pop("interrupt_id", None)
            copies.append(copy)
        conn.execute(insert(CALLS), copies)
        now = time.time()
        conn.execute(insert(MESSAGES), [
            {"session_id": SESSION, "role": "user", "text": f"message {i} " + "x" * 200,
             "status": "delivered", "created_at": now + i * 1e-6, "delivered_at": now}
            for i in range(MESSAGES_COUNT)])


@pytest.fixture
def http(settings: DexSettings) -> Iterator[TestClient]:
    with TestClient(create_api(settings)) as test_client:
        test_client.headers["Authorization"] = \
            f"Bearer {issue_token('test-secret-key', SESSION, permissions=['view'])}"
        yield test_client


def _get(http: TestClient, **params: Any) -> dict[str, Any]:
    response = http.get(f"/sessions/{SESSION}/snapshot", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_a_huge_session_is_served_in_bounded_pages_and_memory(
    big_session: None, http: TestClient, client: DexClient
) -> None:
    # Given 100k messages and 1500 calls, when a view token reads the snapshot
    tracemalloc.start()
    try:
        response = http.get(f"/sessions/{SESSION}/snapshot")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Then it gets the default page: bounded in size and in the memory it took to build
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["messages"]) == 200 and body["messages_more"] is True
    assert len(body["tool_calls"]) == 200 and body["calls_more"] is True
    assert len(response.content) < 200_000, len(response.content)
    assert peak < 20_000_000, f"{peak / 1e6:.1f} MB to build one page"
    assert body["event_cursor"] > 0 and body["limit"] == 200

    # Pages follow on from the cursors, each message and call exactly once, in order
    ids: list[int] = []
    after = 0
    for _ in range(3):
        page = _get(http, limit=1000, messages_after=after)
        ids += [m["id"] for m in page["messages"]]
        after = ids[-1]
    assert len(ids) == 3000 and ids == sorted(set(ids))
    keys: list[str] = []
    cursor: dict[str, Any] = {}
    while True:
        page = _get(http, limit=1000, **cursor)
        keys += [c["key"] for c in page["tool_calls"]]
        if not page["calls_more"]:
            break
        cursor = {"calls_after": keys[-1]}
    assert len(keys) == CALLS_COUNT == len(set(keys))
    # The tail: the newest messages, oldest first, and the ones before them
    tail = _get(http, limit=500, messages_before=MAX_CURSOR)
    tail_ids = [m["id"] for m in tail["messages"]]
    assert tail["messages_more"] and tail_ids == sorted(tail_ids) and len(tail_ids) == 500
    before = _get(http, limit=500, messages_before=tail_ids[0])
    assert [m["id"] for m in before["messages"]][-1] < tail_ids[0]
    # Only the calls not ended yet (all of them here: queued, no worker)
    assert len(_get(http, open_calls=True, limit=10)["tool_calls"]) == 10

    # A limit past the maximum, and a cursor naming no call, are refused naming the field
    too_many = http.get(f"/sessions/{SESSION}/snapshot", params={"limit": 1001})
    assert too_many.status_code == 400 and "limit" in too_many.json()["error"]
    unknown = http.get(f"/sessions/{SESSION}/snapshot", params={"calls_after": "nope"})
    assert unknown.status_code == 400 and "calls_after" in unknown.json()["error"]

    # The Python API keeps its contract: the whole transcript
    snapshot = client.get_agent_snapshot(SESSION)
    assert len(snapshot.messages) == MESSAGES_COUNT
    assert len(snapshot.tool_calls) == CALLS_COUNT


def test_openapi_documents_the_snapshot_page(http: TestClient) -> None:
    schema = http.get("/openapi.json").json()
    params = {p["name"]: p for p in schema["paths"]["/sessions/{session_id}/snapshot"]["get"]
              ["parameters"]}
    assert {"limit", "messages_after", "messages_before", "calls_after", "open_calls"} <= \
        set(params)
    assert params["limit"]["schema"]["maximum"] == 1000
    assert params["limit"]["schema"]["default"] == 200
    page = schema["components"]["schemas"]["SnapshotPage"]["properties"]
    assert {"messages_more", "calls_more", "event_cursor"} <= set(page)
    events = schema["paths"]["/sessions/{session_id}/events"]["get"]["responses"]
    assert "DEX_MAX_EVENT_STREAMS_PER_TOKEN" in events["429"]["description"]
