"""The event stream: every transition as a Server-Sent Event with a cursor, live and resumable.

Served by a real uvicorn on a free port (an SSE stream never ends, so it needs a real socket),
with a real worker running the calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import workers.example_tools  # noqa: F401 - registers lookup_order in this process
from dex_tasks import CallStatus, DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token
from tests.conftest import StartWorker
from tests.helpers import served, wait_until

SESSION = "sess-events"


@dataclass
class Sse:
    id: int
    event: str
    data: dict[str, Any]


@pytest.fixture
def base_url(settings: DexSettings) -> Iterator[str]:
    """The API served by uvicorn in a thread of this process."""
    with served(create_api(settings, event_poll_seconds=0.05, heartbeat_seconds=0.5)) as url:
        yield url


def _token(session: str = SESSION) -> str:
    # tests.conftest.fast_settings' key; reading the stream needs only the view permission.
    return issue_token("test-secret-key", session, permissions=["view"])


def read_events(response: httpx.Response, until: Any, limit: int = 50) -> list[Sse]:
    """Parse SSE messages from ``response`` until ``until(messages)`` is true."""
    messages: list[Sse] = []
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line == "":
            if "data" in fields:
                messages.append(Sse(int(fields["id"]), fields["event"],
                                    json.loads(fields["data"])))
                if until(messages) or len(messages) >= limit:
                    return messages
            fields = {}
            continue
        if line.startswith(":"):
            continue  # a keep-alive comment
        name, _, value = line.partition(":")
        fields[name] = value.removeprefix(" ")
    raise AssertionError(f"stream ended after {messages}")


def _finished(key: str) -> Any:
    return lambda ms: any(m.event == "tool_call_finished" and m.data["key"] == key for m in ms)


def test_stream_delivers_a_calls_transitions_live_with_increasing_cursors(
    base_url: str, client: DexClient, start_worker: StartWorker
) -> None:
    start_worker(concurrency=1)
    headers = {"Authorization": f"Bearer {_token()}"}
    with httpx.Client(base_url=base_url, timeout=20) as http, \
            http.stream("GET", f"/sessions/{SESSION}/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        # Given a stream opened on an empty session, when a call is made and runs
        record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        # Then its transitions arrive on the open stream, in order, without a new request
        messages = read_events(response, _finished(record.key))
    assert [m.event for m in messages] == [
        "tool_call_requested", "tool_call_started", "tool_call_finished"]
    ids = [m.id for m in messages]
    assert ids == sorted(set(ids))
    assert all(m.data["id"] == m.id and m.data["key"] == record.key for m in messages)
    assert messages[-1].data["to_status"] == "succeeded"
    assert client.get_tool_call(record.key).status is CallStatus.SUCCEEDED


def test_stream_resumes_after_a_cursor_or_last_event_id(
    base_url: str, client: DexClient, start_worker: StartWorker
) -> None:
    start_worker(concurrency=1)
    first = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                             tool="lookup_order", arguments={"order_id": "1001"})
    second = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c2",
                              tool="lookup_order", arguments={"order_id": "1002"})
    client.wait(first.key, 20)
    client.wait(second.key, 20)
    everything = client.events(SESSION)
    assert len(everything) == 6
    cursor = everything[2].id
    expected = [(e.id, e.event) for e in everything[3:]]
    token = _token()

    with httpx.Client(base_url=base_url, timeout=20) as http:
        # ?after= with the token in the query (how the page's EventSource connects)
        with http.stream("GET", f"/sessions/{SESSION}/events",
                         params={"after": cursor, "token": token}) as response:
            got = read_events(response, lambda ms: len(ms) == len(expected))
        assert [(m.id, m.event) for m in got] == expected
        # Last-Event-ID (how a browser reconnects) wins over an older ?after=
        with http.stream("GET", f"/sessions/{SESSION}/events", params={"after": 0},
                         headers={"Authorization": f"Bearer {token}",
                                  "Last-Event-ID": str(cursor)}) as response:
            got = read_events(response, lambda ms: len(ms) == len(expected))
        assert [(m.id, m.event) for m in got] == expected


def test_stream_closes_when_the_client_goes_and_refuses_other_sessions(
    base_url: str, client: DexClient
) -> None:
    with httpx.Client(base_url=base_url, timeout=20) as http:
        refused = http.get(f"/sessions/{SESSION}/events",
                           params={"token": _token("another-session")})
        assert refused.status_code == 403
        with http.stream("GET", f"/sessions/{SESSION}/events",
                         params={"token": _token()}) as response:
            # The first keep-alive shows the stream is being served and counted. (Checked
            # inside the loop: leaving iter_lines closes the connection.)
            for line in response.iter_lines():
                if line.startswith(": keep-alive"):
                    assert http.get("/healthz").json()["event_streams"] == 1
                    break
        # When the client disconnects, the server's poll loop ends too.
        wait_until(lambda: http.get("/healthz").json()["event_streams"] == 0, 10,
                   "the server to close the stream")


def test_the_largest_cursor_streams_and_one_past_it_is_refused_before_the_stream(
    base_url: str, client: DexClient
) -> None:
    # Given a session with events, a cursor at the top of the 64-bit range streams (nothing
    # after it) instead of failing in the store once the stream has begun.
    headers = {"Authorization": f"Bearer {_token()}"}
    client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                     tool="lookup_order", arguments={"order_id": "1001"})
    with httpx.Client(base_url=base_url, timeout=20) as http:
        for params, extra in (({"after": 2**63 - 1}, {}),
                              ({}, {"Last-Event-ID": str(2**63 - 1)})):
            with http.stream("GET", f"/sessions/{SESSION}/events", params=params,
                             headers={**headers, **extra}) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    assert not line.startswith(("id:", "data:")), line
                    if line.startswith(": keep-alive"):
                        break  # polled the store at least once past the start, and lives
        # One past it (or any other bad cursor) is a 400 that names the field, not a 200
        # whose stream aborts.
        for params, extra, field in (({"after": 2**63}, {}, "after"),
                                     ({}, {"Last-Event-ID": str(2**64)}, "Last-Event-ID"),
                                     ({"after": "-5"}, {}, "after")):
            refused = http.get(f"/sessions/{SESSION}/events", params=params,
                               headers={**headers, **extra})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"].startswith(f"{field} must be an integer")
