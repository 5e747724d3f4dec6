"""Webhook delivery latency: ``python -m bench.webhook_latency [--calls 100] [--store sqlite]``.

From the commit of the event (a call that starts waiting for approval, ``call_tool``) to the
receiver reading the signed body, for each event: a private ``redis-server``, a fresh store,
one ``dex-tasks worker -c 2`` (which delivers), a local HTTP receiver that verifies every
signature, and ``--calls`` calls of ``refund_payment`` made by an agent in this process, each
after the previous one's webhook arrived. Prints p50/p99/max in milliseconds; asserts nothing
about time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.infra import (
    RedisServer,
    WorkerProcess,
    child_env,
    fresh_store,
    percentile,
    postgres_admin_url,
    wait_for,
    wait_for_catalog,
)
from dex_tasks import DexClient, DexSettings, verify_webhook

SECRET = "bench-webhook-secret"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres-url", default=None)
    options = parser.parse_args()
    arrived: dict[str, float] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            event = verify_webhook(body, self.headers["Dex-Signature"], SECRET)
            with lock:
                arrived.setdefault(event["call"]["key"], time.time())
            self.send_response(204)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    redis_server = RedisServer().start()
    workdir = Path(tempfile.mkdtemp(prefix="dex-bench-webhooks-"))
    try:
        with fresh_store(options.store, postgres_admin_url(options.postgres_url),
                         workdir) as database_url:
            values = {"redis_url": redis_server.url(), "database_url": database_url,
                      "secret_key": "bench", "webhook_urls": url, "webhook_secret": SECRET}
            env = child_env({f"DEX_{k.upper()}": v for k, v in values.items()})
            worker = WorkerProcess.start(
                "webhooks", [sys.executable, "-m", "dex_tasks.ops.cli", "worker", "--tools",
                             "workers.example_tools", "-c", "2"], env, workdir / "worker.log")
            try:
                with DexClient(DexSettings(**values)) as client:  # type: ignore[arg-type]
                    wait_for_catalog(client, "refund_payment", worker.check_alive)
                    committed: dict[str, float] = {}
                    for i in range(options.calls):
                        record = client.call_tool(
                            session_id="bench", turn_id=f"t{i}", tool_call_id="c",
                            tool="refund_payment",
                            arguments={"charge_id": f"ch_{i}", "amount_cents": i})
                        committed[record.key] = record.created_at.timestamp()
                        # One at a time: the latency of a delivery, not a backlog's.
                        wait_for(lambda k=record.key: k in arrived, 60,  # type: ignore[misc]
                                 f"the webhook of {record.key}", interval=0.001)
            finally:
                worker.stop()
    finally:
        redis_server.stop()
        server.shutdown()
    latencies = sorted((arrived[k] - committed[k]) * 1000 for k in committed)
    print(json.dumps({"store": options.store, "calls": options.calls,
                      "p50_ms": round(percentile(latencies, 50), 1),
                      "p99_ms": round(percentile(latencies, 99), 1),
                      "max_ms": round(latencies[-1], 1)}))


if __name__ == "__main__":
    main()
