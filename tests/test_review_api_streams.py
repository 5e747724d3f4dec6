"""Event streams end when their token expires, are capped per token and per API process, and
idle ones do not read the store in a loop (issue 19, findings 5 and 6: a stream kept streaming
after its token expired; 200 idle streams cost half a core and 465 store transactions/s).

Served by a real uvicorn in a thread (an SSE stream never ends by itself)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event

import workers.example_tools  # noqa: F401 - registers lookup_order in this process
from dex_tasks import DexClient, DexSettings
from dex_tasks.api import create_api
from dex_tasks.tokens import issue_token
from tests.helpers import served, wait_until

SESSION = "sess-streams"
SECRET = "test-secret-key"  # tests.conftest.fast_settings


def _token(ttl: float = 3600, session: str = SESSION) -> str:
    return issue_token(SECRET, session, ttl, permissions=["view"])


def _open(stack: ExitStack, http: httpx.Client, token: str,
          session: str = SESSION) -> httpx.Response:
    return stack.enter_context(http.stream(
        "GET", f"/sessions/{session}/events", headers={"Authorization": f"Bearer {token}"}))


@pytest.fixture
def api(settings: DexSettings) -> FastAPI:
    limited = settings.model_copy(update={"max_event_streams": 3,
                                          "max_event_streams_per_token": 2})
    return create_api(limited, event_poll_seconds=0.05, heartbeat_seconds=0.5)


@pytest.fixture
def base_url(api: FastAPI) -> Iterator[str]:
    with served(api) as url:
        yield url


def test_a_stream_ends_when_its_token_expires(base_url: str) -> None:
    token = _token(ttl=2)
    started = time.monotonic()
    lines: list[str] = []
    with httpx.Client(base_url=base_url, timeout=10) as http, ExitStack() as stack:
        response = _open(stack, http, token)
        assert response.status_code == 200
        for line in response.iter_lines():  # heartbeats every 0.5 s keep lines coming
            lines.append(line)
            assert time.monotonic() - started < 6, f"still streaming after expiry: {lines}"
    # The stream said why and ended soon after the expiry (tokens count whole seconds)
    assert "event: token_expired" in lines, lines
    assert time.monotonic() - started < 4.5
    # and the browser's reconnection with the same token is refused
    again = httpx.get(f"{base_url}/sessions/{SESSION}/events",
                      headers={"Authorization": f"Bearer {token}"})
    assert again.status_code == 401


def test_streams_are_capped_per_token_and_per_process_with_a_429_naming_the_limit(
    base_url: str
) -> None:
    first, second, third = _token(), _token(session="other"), _token(session="third")
    with httpx.Client(base_url=base_url, timeout=10) as http, ExitStack() as stack:
        a1 = _open(stack, http, first)
        _open(stack, http, first)
        # A third stream of the same token is refused, naming the setting
        refused = http.get(f"/sessions/{SESSION}/events",
                           headers={"Authorization": f"Bearer {first}"})
        assert refused.status_code == 429
        assert "DEX_MAX_EVENT_STREAMS_PER_TOKEN" in refused.json()["error"]
        assert refused.headers["Retry-After"]
        # Another token may still open one, up to the process's limit of three
        assert _open(stack, http, second, "other").status_code == 200
        full = http.get("/sessions/third/events", headers={"Authorization": f"Bearer {third}"})
        assert full.status_code == 429
        assert "(DEX_MAX_EVENT_STREAMS)" in full.json()["error"]
        assert http.get("/healthz").json()["event_streams"] == 3
        # When a stream closes, its place is given back
        a1.close()
        wait_until(lambda: http.get("/healthz").json()["event_streams"] == 2, 10,
                   "the closed stream to be counted out")
        assert _open(stack, http, first).status_code == 200


def test_idle_streams_do_not_read_the_store_and_still_get_new_events_at_once(
    settings: DexSettings, client: DexClient
) -> None:
    api = create_api(settings.model_copy(update={"max_event_streams_per_token": 50}),
                     event_poll_seconds=0.05, heartbeat_seconds=15)
    statements = 0

    def count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    store = api.state.dex.client.store
    event.listen(store.read_engine, "before_cursor_execute", count)
    streams = 20
    with served(api) as url, httpx.Client(base_url=url, timeout=10) as http, \
            ExitStack() as stack:
        opened = [_open(stack, http, _token()) for _ in range(streams)]
        wait_until(lambda: http.get("/healthz").json()["event_streams"] == streams, 10,
                   "every stream open")
        # Given 20 idle streams, polled every 0.05 s before: 400 reads a second
        time.sleep(0.5)  # past each stream's first read
        before = statements
        time.sleep(2.0)
        idle = statements - before
        # Then the process read the store about once per poll for all of them together
        assert idle < 2.0 / 0.05 * 2, f"{idle} store statements in 2 s from idle streams"
        # And a new event still reaches a stream at once
        record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                                  tool="lookup_order", arguments={"order_id": "1001"})
        sent = time.monotonic()
        lines = opened[0].iter_lines()
        while True:
            line = next(lines)
            if line.startswith("data:") and record.key in line:
                break
        assert time.monotonic() - sent < 2
