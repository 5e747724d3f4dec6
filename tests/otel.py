"""OpenTelemetry for the tracing tests: the test process's spans in the SDK's in-memory
exporter, and the spans of the `dex-tasks` subprocesses (worker, API, sweep) received by a small
OTLP/HTTP receiver on loopback, which they export to from the standard `OTEL_*` variables, as in
production (dex_tasks/ops/tracing_setup.py). Both end up as :class:`Span` rows to assert on."""

from __future__ import annotations

import gzip
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dex_tasks import tracing


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    service: str
    start: int
    end: int
    attributes: dict[str, Any] = field(hash=False)
    error: bool = False
    links: tuple[str, ...] = ()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) on a free loopback port."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        rows = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rows.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex() or None,
                        service=str(resource.get("service.name")),
                        start=s.start_time_unix_nano, end=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2,
                        links=tuple(link.span_id.hex() for link in s.links)))
        with self.lock:
            self.spans.extend(rows)

    def env(self) -> dict[str, str]:
        """What a subprocess needs to export its spans here, promptly."""
        # tests/conftest.py turns the SDK off for the run (CrewAI's telemetry): on here.
        return {"OTEL_SDK_DISABLED": "false",
                "OTEL_EXPORTER_OTLP_ENDPOINT": self.url, "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


class Agent:
    """The test process's tracing: an SDK provider with the in-memory exporter, which dex-tasks
    traces with (``tracing.set_tracer_provider``) and frameworks are handed."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        # tests/conftest.py turns the SDK off for the run (CrewAI's telemetry); the provider
        # reads that when built.
        saved = os.environ.pop("OTEL_SDK_DISABLED", None)
        try:
            self.provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
        finally:
            if saved is not None:
                os.environ["OTEL_SDK_DISABLED"] = saved
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("test-agent")

    def spans(self) -> list[Span]:
        return [_readable(s) for s in self.exporter.get_finished_spans()]


def _readable(s: ReadableSpan) -> Span:
    ctx = s.context
    assert ctx is not None
    return Span(name=s.name, trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}",
                parent_id=f"{s.parent.span_id:016x}" if s.parent else None,
                service=str(s.resource.attributes.get("service.name")),
                start=s.start_time or 0, end=s.end_time or 0,
                attributes=dict(s.attributes or {}), error=s.status.status_code.value == 2,
                links=tuple(f"{link.context.span_id:016x}" for link in s.links))


@contextmanager
def traced_agent() -> Iterator[Agent]:
    """dex-tasks traces with an in-memory provider in this process, until the block ends."""
    agent = Agent()
    tracing.set_tracer_provider(agent.provider)
    try:
        yield agent
    finally:
        tracing.set_tracer_provider(None)
        agent.provider.shutdown()


def one(spans: list[Span], name: str, **attributes: Any) -> Span:
    """The single span named ``name`` with these attributes (AssertionError otherwise)."""
    found = [s for s in spans if s.name == name
             and all(s.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, (name, attributes, [(s.name, s.attributes) for s in spans])
    return found[0]
