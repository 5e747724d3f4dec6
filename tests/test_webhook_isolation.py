"""Issue 28, item 6: a slow webhook receiver never holds up tool calls.

Deliveries are sent from the worker's main process, not from its pool, and each attempt has a
total deadline (``DEX_WEBHOOK_TIMEOUT_SECONDS``) that a receiver which hangs, or trickles its
answer a byte at a time, cannot stretch. Real worker (``-c 2``), real Redis, a real local
receiver; the calls are approval-gated, so every one of them makes two events.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dex_tasks import DexClient
from dex_tasks.store import webhooks as outbox
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import wait_until

SECRET = "whsec-isolation"
CALLS = 10
# The budget from each call's approval to its tool's end. Ten tiny calls on two slots take a
# few hundred milliseconds; a delivery holding a slot costs a call the whole deadline (3 s).
BUDGET_SECONDS = 2.0
DEADLINE_SECONDS = 3.0
TRICKLE_EVERY_SECONDS = 1.0


@dataclass
class SlowReceiver:
    """A receiver that ``hang``s (reads the request, never answers) or ``trickle``s (answers a
    byte every second, never finishing) until :attr:`answering` is set; then it answers 200."""

    mode: str
    answering: threading.Event = field(default_factory=threading.Event)
    stalled: int = 0
    accepted: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def accepted_ids(self) -> set[str]:
        with self.lock:
            return {json.loads(r)["id"] for r in (a["body"] for a in self.accepted)}


@pytest.fixture(params=["hang", "trickle"])
def slow_receiver(request: pytest.FixtureRequest) -> Iterator[SlowReceiver]:
    state = SlowReceiver(mode=request.param)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if state.answering.is_set():
                with state.lock:
                    state.accepted.append({"body": body})
                self.send_response(200)
                self.end_headers()
                return
            with state.lock:
                state.stalled += 1
            if state.mode == "hang":
                state.answering.wait(60)
                return
            # Trickle: a byte at a time, each well within httpx's per-read timeout.
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n":
                if state.answering.wait(TRICKLE_EVERY_SECONDS):
                    return
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:  # the sender gave up: its deadline passed
                    return

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.answering.set()
    server.shutdown()
    server.server_close()


def test_a_slow_receiver_never_delays_approved_calls_and_gets_every_event_later(
    start_worker: StartWorker, redis_url: str, sqlite_url: str, slow_receiver: SlowReceiver,
    ledger_path: Any,
) -> None:
    settings = fast_settings(redis_url, sqlite_url, webhook_urls=slow_receiver.url,
                             webhook_secret=SECRET, webhook_timeout_seconds=DEADLINE_SECONDS,
                             webhook_backoff_seconds=1, webhook_backoff_max_seconds=1,
                             webhook_max_attempts=100)
    start_worker(concurrency=2, extra_env=settings_env(settings, ledger_path))
    with DexClient(settings) as client:
        # Given ten approval-gated calls, whose awaiting events reach a receiver that stalls
        calls = [client.call_tool(session_id="s-slow", turn_id="t1", tool_call_id=f"c{i}",
                                  tool="refund_payment",
                                  arguments={"charge_id": f"ch_{i}", "amount_cents": 100 + i})
                 for i in range(CALLS)]
        assert {c.status.value for c in calls} == {"awaiting_approval"}
        wait_until(lambda: slow_receiver.stalled >= 2, 30, "deliveries to stall")
        # When a person approves all ten (ten more events for the stalled receiver)
        approved_at = {}
        for call in calls:
            approved_at[call.key] = time.time()
            assert client.resolve_interrupt("s-slow", call.interrupt_id or "", True,
                                            approver="alice")
        # Then every call runs within the budget of its approval: no delivery holds a slot a
        # call could use
        done = [client.wait(c.key, timeout=60) for c in calls]
        assert {d.status.value for d in done} == {"succeeded"}
        waited = max(d.finished_at.timestamp() - approved_at[d.key] for d in done
                     if d.finished_at is not None)
        print(f"receiver {slow_receiver.mode}: each of {CALLS} approved calls ended within "
              f"{waited:.2f}s of its approval")
        assert waited < BUDGET_SECONDS, f"an approved call took {waited:.2f}s to run"
        # And each attempt was cut off by its total deadline, not left to run on
        wait_until(lambda: any(r["attempts"] >= 1 for r in outbox.list_deliveries(
            client.store, limit=100)), 30, "a first attempt to be recorded")
        if slow_receiver.mode == "trickle":
            errors = {r["last_error"] for r in outbox.list_deliveries(client.store, limit=100)
                      if r["attempts"]}
            assert any("DEX_WEBHOOK_TIMEOUT_SECONDS" in (e or "") for e in errors), errors
        # And once the receiver answers, every event arrives: an awaiting and a decided event
        # per call
        slow_receiver.answering.set()
        wait_until(lambda: len(slow_receiver.accepted_ids()) == 2 * CALLS, 60,
                   "every event to be accepted")
        wait_until(lambda: {r["status"] for r in outbox.list_deliveries(client.store, limit=100)}
                   == {"delivered"}, 30, "every delivery to be recorded delivered")
        rows = outbox.list_deliveries(client.store, limit=100)
    assert len(rows) == 2 * CALLS
    assert sorted(r["event"] for r in rows) == sorted(
        ["tool_call_awaiting_approval"] * CALLS + ["tool_call_decided"] * CALLS)
