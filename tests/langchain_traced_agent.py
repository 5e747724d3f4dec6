"""An agent process for tests/test_tracing_frameworks.py: a LangChain ``create_agent`` graph
traced with OpenTelemetry through Traceloop's LangChain instrumentation.

    python -m tests.langchain_traced_agent THREAD HOW

``HOW`` is ``middleware`` (``DexMiddleware`` runs the calls; ``invoke``) or ``tool-node`` (the
catalog's tools run their own calls in LangGraph's tool node; ``ainvoke``). The model asks for
order 1001 with ``lookup_order``, then answers "done", which is printed. Spans go over
OTLP/HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` as the service ``agent``; the DEX_* environment
configures the client.

A process of its own because the instrumentation cannot be taken off again: its
``uninstrument`` leaves LangChain's classes wrapped (it looks the wrapped attributes up by a
dotted name it cannot resolve), so in the test process it would go on tracing every later test
(and a second ``instrument`` would not reach the new tracer provider).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.langchain import LangchainInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from dex_tasks import DexClient
from dex_tasks.integrations.langchain import DexMiddleware, dex_tools
from tests.langchain_agent_proc import ScriptedChatModel, ai


def main(thread: str, how: str) -> None:
    # As an application sets it up, before its first graph runs. Spans are exported as they
    # end (SimpleSpanProcessor), so all of them have reached the test when this process exits.
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    LangchainInstrumentor().instrument()

    model = ScriptedChatModel(messages=iter([
        ai(("lookup_order", {"order_id": "1001"}, "call-1")),
        AIMessage("done"),
    ]))
    request: Any = {"messages": [("user", "Where is order 1001?")]}
    config: Any = {"configurable": {"thread_id": thread}}
    with DexClient.from_env() as client:
        middleware = [DexMiddleware(client)] if how == "middleware" else []
        graph = create_agent(model, tools=dex_tools(client, ["lookup_order"]),
                             middleware=middleware, checkpointer=InMemorySaver())
        if how == "middleware":
            result = graph.invoke(request, config)
        else:
            result = asyncio.run(graph.ainvoke(request, config))
    provider.shutdown()
    print(result["messages"][-1].content, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
