"""Approvals that reach people, item 4: signed webhooks, delivered at least once by real
workers to a real (local) receiver that is down for a while, on SQLite and PostgreSQL.

The documented rule: each event is accepted (2xx) by the receiver once, except when a worker is
lost between the receiver's answer and its record, when the same event id comes again.
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
import redis
from typer.testing import CliRunner

from dex_tasks import DexClient, WebhookSignatureError, verify_webhook
from dex_tasks.broker.metrics import WEBHOOKS_KEY
from dex_tasks.ops.cli import app as cli_app
from dex_tasks.store import webhooks as outbox
from dex_tasks.webhooks import sign
from dex_tasks.worker import sweeps
from dex_tasks.worker.execution import Runtime
from tests.conftest import StartWorker, fast_settings, settings_env
from tests.helpers import wait_until

SECRET = "whsec-test"


def test_verify_webhook_accepts_a_genuine_signature_and_refuses_the_rest() -> None:
    body = b'{"id": "e1", "type": "tool_call_decided"}'
    header = sign(SECRET, body, now=1_000_000)
    assert verify_webhook(body, header, SECRET, now=1_000_100)["id"] == "e1"
    bad = [
        (body + b" ", header, "does not match"),                  # the body was changed
        (body, header, "tolerance"),                               # replayed later
        (body, "", "no Dex-Signature"),
        (body, "v1=abc", "t=<unix>"),
        (body, "t=soon,v1=abc", "unix time"),
        (body, sign("another-secret", body, now=1_000_000), "does not match"),
    ]
    for raw, head, why in bad:
        with pytest.raises(WebhookSignatureError, match=why):
            verify_webhook(raw, head, SECRET, now=1_000_100 if why != "tolerance" else 1_009_000)


@dataclass
class Receiver:
    """A local HTTP receiver that answers 503 while ``down``; keeps every request."""

    down: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def accepted(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["status"] == 200]

    def refused(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["status"] != 200]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status = 503 if state.down else 200
            with state.lock:
                state.requests.append({"status": status, "body": body,
                                       "headers": dict(self.headers), "at": time.time()})
            self.send_response(status)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _settings(redis_url: str, database_url: str, receiver: Receiver) -> Any:
    return fast_settings(redis_url, database_url, webhook_urls=receiver.url,
                         webhook_secret=SECRET, webhook_backoff_seconds=1,
                         webhook_backoff_max_seconds=1, webhook_max_attempts=60,
                         webhook_deadline_lead_seconds=600, public_url="http://dex.example")


def test_webhooks_reach_a_receiver_that_was_down_once_each_signed(
    start_worker: StartWorker, redis_url: str, database_url: str, receiver: Receiver,
    ledger_path: Any,
) -> None:
    settings = _settings(redis_url, database_url, receiver)
    env = settings_env(settings, ledger_path)
    start_worker(extra_env=env)
    with DexClient(settings) as client:
        rt = Runtime(settings=settings, store=client.store,
                     redis=redis.Redis.from_url(redis_url), app=client.app)
        # Given a receiver that is down, two calls start waiting; neither waits for it (the
        # receiver is only ever called by the workers, after the calls' commits)
        refund = client.call_tool(session_id="s-hook", turn_id="t1", tool_call_id="c1",
                                  tool="issue_refund",
                                  arguments={"charge_id": "ch_1", "amount_cents": 25_000})
        urgent = client.call_tool(session_id="s-hook", turn_id="t1", tool_call_id="c2",
                                  tool="refund_payment", approval_deadline=300,
                                  arguments={"charge_id": "ch_2", "amount_cents": 5})
        assert refund.status.value == urgent.status.value == "awaiting_approval"
        # And the deadline sweep finds the one due within the lead time, once
        assert sweeps.run_job(rt, "warn_deadlines") == 1
        assert sweeps.run_job(rt, "warn_deadlines") == 0
        # When the workers have tried (and been refused) a few times, the receiver comes up
        wait_until(lambda: len(receiver.refused()) >= 6, 30)
        receiver.down = False
        wait_until(lambda: len({json.loads(r["body"])["id"] for r in receiver.accepted()})
                   == 3, 30)
        # And a person decides both calls: two more events
        assert client.resolve_interrupt("s-hook", refund.interrupt_id or "", True,
                                        approver="alice")
        assert client.resolve_interrupt("s-hook", urgent.interrupt_id or "", False,
                                        approver="bob", rejection_message="no")
        wait_until(lambda: len({json.loads(r["body"])["id"] for r in receiver.accepted()})
                   == 5, 30)
        # (the receiver answered before the worker recorded its answer: wait for the records,
        # or the sweep below, a minute ahead, takes one still being recorded for stranded)
        wait_until(lambda: {r["status"] for r in outbox.list_deliveries(client.store)}
                   == {"delivered"}, 30)
        # And a delivery whose publish was lost is sent by the republish sweep
        lost = DexClient(settings)
        lost.store.publish_webhooks = None
        late = lost.call_tool(session_id="s-hook", turn_id="t2", tool_call_id="c3",
                              tool="refund_payment",
                              arguments={"charge_id": "ch_3", "amount_cents": 1})
        lost.close()
        assert sweeps.republish_webhooks(rt) == 0  # not stale yet: a retry may be waiting
        assert sweeps.republish_webhooks(rt, now=time.time() + 60) == 1
        wait_until(lambda: len({json.loads(r["body"])["id"] for r in receiver.accepted()})
                   == 6, 30)
        # (the receiver answered before the worker recorded its answer: wait for the record)
        wait_until(lambda: {r["status"] for r in outbox.list_deliveries(client.store)}
                   == {"delivered"}, 30)
        rows = outbox.list_deliveries(client.store, limit=100)
        rt.redis.close()

    # Then every event reached the receiver, accepted exactly once
    accepted = receiver.accepted()
    ids = [json.loads(r["body"])["id"] for r in accepted]
    assert len(ids) == len(set(ids)) == 6
    events = sorted(json.loads(r["body"])["type"] for r in accepted)
    assert events == sorted(["tool_call_awaiting_approval"] * 3
                            + ["approval_deadline_near"] + ["tool_call_decided"] * 2)
    # And every request (refused ones too) is signed, with the event id in a header
    for request in receiver.requests:
        event = verify_webhook(request["body"], request["headers"]["Dex-Signature"], SECRET)
        assert request["headers"]["Dex-Event-Id"] == event["id"]
    # And the body carries the call, the interrupt and the page link
    bodies = {(b["type"], b["call"]["key"]): b for b in
              (json.loads(r["body"]) for r in accepted)}
    decided = bodies[("tool_call_decided", refund.key)]
    assert decided["interrupt"]["decision"] == "approved"
    assert decided["interrupt"]["decided_by"] == "alice"
    assert decided["call"]["arguments"] == {"charge_id": "ch_1", "amount_cents": 25_000}
    assert decided["call"]["approval_rule"]["reason"] == "amount_cents=25000 > 10000"
    assert decided["page"] == "http://dex.example/sessions/s-hook"
    assert bodies[("approval_deadline_near", urgent.key)]["interrupt"]["deadline"]
    assert ("tool_call_awaiting_approval", late.key) in bodies
    # And the outbox shows each delivery's attempts; the first ones were retried
    assert {r["status"] for r in rows} == {"delivered"} and len(rows) == 6
    first = [r for r in rows if r["key"] == refund.key and r["event"].endswith("approval")]
    assert first[0]["attempts"] >= 2 and first[0]["last_status"] == 200
    # And the metrics count the attempts by outcome
    with redis.Redis.from_url(redis_url) as r:
        counts = {k.decode(): int(v) for k, v in r.hgetall(WEBHOOKS_KEY).items()}
    assert counts["delivered"] == 6 and counts["retried"] >= len(receiver.refused()) - 1
    # And the CLI lists them
    listed = CliRunner().invoke(cli_app, ["webhooks", "--json"], env=env)
    assert listed.exit_code == 0, listed.output
    assert len(json.loads(listed.stdout)) == 6
