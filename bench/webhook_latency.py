"""Webhook delivery latency: ``python -m bench webhooks [--calls 100] [--store both]`` (also
``python -m bench.webhook_latency [--calls 100] [--store sqlite]``; part of ``make bench``).

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
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.infra import (
    RedisServer,
    WorkerProcess,
    bench_session,
    child_env,
    fresh_store,
    percentile,
    postgres_admin_url,
    save_results,
    wait_for,
    wait_for_catalog,
)
from dex_tasks import DexClient, DexSettings, verify_webhook

SECRET = "bench-webhook-secret"


class _Receiver:
    """A local HTTP receiver that verifies every signature and notes when each call's first
    event arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        lock = threading.Lock()
        arrived = self.arrived

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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


def _one_store(kind: str, calls: int, postgres_url: str | None, redis_server: RedisServer,
               workdir: Path) -> dict[str, Any]:
    receiver = _Receiver()
    try:
        with fresh_store(kind, postgres_url, workdir) as database_url:
            values = {"redis_url": redis_server.url(), "database_url": database_url,
                      "secret_key": "bench", "webhook_urls": receiver.url,
                      "webhook_secret": SECRET}
            env = child_env({f"DEX_{k.upper()}": v for k, v in values.items()})
            worker = WorkerProcess.start(
                f"webhooks-{kind}", [sys.executable, "-m", "dex_tasks.ops.cli", "worker",
                                     "--tools", "workers.example_tools", "-c", "2"],
                env, workdir / f"worker-{kind}.log")
            committed: dict[str, float] = {}
            try:
                with DexClient(DexSettings(**values)) as client:  # type: ignore[arg-type]
                    wait_for_catalog(client, "refund_payment", worker.check_alive)
                    for i in range(calls):
                        record = client.call_tool(
                            session_id="bench", turn_id=f"t{i}", tool_call_id="c",
                            tool="refund_payment",
                            arguments={"charge_id": f"ch_{i}", "amount_cents": i})
                        committed[record.key] = record.created_at.timestamp()
                        # One at a time: the latency of a delivery, not a backlog's.
                        wait_for(lambda k=record.key: k in receiver.arrived,  # type: ignore[misc]
                                 60, f"the webhook of {record.key}", interval=0.001)
            finally:
                worker.stop()
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
    latencies = sorted((receiver.arrived[k] - committed[k]) * 1000 for k in committed)
    return {"store": kind, "calls": calls, "p50_ms": round(percentile(latencies, 50), 1),
            "p99_ms": round(percentile(latencies, 99), 1), "max_ms": round(latencies[-1], 1)}


def run_webhook_latency(*, calls: int, stores: list[str], postgres_url: str | None,
                        out_dir: Path | None = None,
                        console: Console | None = None) -> dict[str, Any]:
    """Measure on every store; print one line per store; write the results."""
    console = console or Console()
    rows = []
    with bench_session("webhooks", stores, postgres_url) as (redis_server, machine, workdir):
        for kind in stores:
            with console.status(f"webhook latency on {kind}: {calls} calls"):
                rows.append(_one_store(kind, calls, postgres_url, redis_server, workdir))
            console.print(json.dumps(rows[-1]))
    payload = {"config": {"calls": calls, "stores": stores}, "machine": machine,
               "summary": rows, "targets": []}
    return save_results("webhook_latency", payload, out_dir, console)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres-url", default=None)
    options = parser.parse_args()
    run_webhook_latency(calls=options.calls, stores=[options.store],
                        postgres_url=postgres_admin_url(options.postgres_url))


if __name__ == "__main__":
    main()
