"""A framework's own span is the parent of dex-tasks' spans (issue 31 item 3).

Pydantic AI traces with OpenTelemetry itself (``Agent.instrument``, what Logfire turns on): its
``execute_tool {name}`` span is current while the tool runs, so the call ``DexCapability``
makes there opens ``call_tool`` under it, and the worker's spans follow. Offline, with Pydantic
AI's ``FunctionModel``, against a real ``dex-tasks worker`` exporting OTLP to this test.

The OpenAI Agents SDK and LangChain trace with systems of their own (the SDK's trace
processors, LangChain's callbacks). A bridge turns those into OpenTelemetry spans, and the
framework's tool span is the parent only if the bridge makes it the current span while the
tool runs. These two do, and the tests install them (the ``dev`` extra):

* ``openinference-instrumentation-openai-agents``: a trace processor that attaches the span it
  makes of each SDK span when that starts, so the SDK's function span around
  ``on_invoke_tool`` is current in the tool. With the SDK's own ``ScriptedModel``.
* ``opentelemetry-instrumentation-langchain`` (Traceloop's): a callback handler, run inline,
  that attaches the span of each run it starts, so ``on_tool_start`` (LangChain's own in a
  ``ToolNode``, or the one ``DexMiddleware`` reports for each call it runs) makes the tool's
  span current. Its agent is a process of its own (tests/langchain_traced_agent.py: the
  instrumentation cannot be taken off again), exporting OTLP here as the worker does.

OpenInference's LangChain bridge does not attach its spans (deliberately, its source says:
callbacks cannot promise to detach them), so under it ``call_tool`` starts a trace of its own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import agents
import pytest
from agents.testing import ScriptedModel, assistant_message, function_call
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

from dex_tasks import CallStatus, DexClient
from dex_tasks.integrations.openai_agents import dex_context, dex_function_tools
from dex_tasks.integrations.pydantic_ai import DexCapability
from tests.conftest import StartWorker
from tests.helpers import ROOT, wait_until
from tests.otel import Receiver, Span, one, receiver, traced_agent


def call_under(mine: list[Span], framework: Span, run: Span, key: str) -> Span:
    """The ``call_tool`` span among ``mine``, checked to be the child of the framework's
    ``framework`` span, in the trace of its ``run`` span, for the call ``key``."""
    ours = one(mine, "call_tool lookup_order")
    assert ours.parent_id == framework.span_id
    assert ours.trace_id == framework.trace_id == run.trace_id
    assert ours.attributes["dex.idempotency_key"] == key
    return ours


def assert_worker_joins(otlp: Receiver, ours: Span) -> None:
    """The worker's spans of the call (exported to ``otlp``) are in ``ours``' trace, its
    delivery under ``ours``."""

    def worker_run() -> list[Span] | None:
        # Until `process`, the delivery's last span to end, so its last exported; the
        # worker's only (a framework may call its own tool span execute_tool too).
        spans = [s for s in otlp.spans
                 if s.trace_id == ours.trace_id and s.service == "dex-tasks-worker"]
        return spans if any(s.name == "process lookup_order" for s in spans) else None

    theirs = wait_until(worker_run, 30, "the worker's spans")
    delivery = one(theirs, "process lookup_order")
    assert delivery.parent_id == ours.span_id
    assert one(theirs, "execute_tool lookup_order").parent_id == delivery.span_id


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if sum(isinstance(m, ModelResponse) for m in messages) == 0:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "1001"},
                                                 tool_call_id="call-1")])
    return ModelResponse(parts=[TextPart("done")])


def test_pydantic_ais_tool_span_is_the_parent(client: DexClient,
                                              start_worker: StartWorker) -> None:
    with receiver() as otlp, traced_agent() as traced:
        start_worker(extra_env=otlp.env())
        # Given a Pydantic AI agent traced with OpenTelemetry, its tools run through dex-tasks
        agent: Agent[None, Any] = Agent(FunctionModel(_model), capabilities=[DexCapability(client)])
        agent.instrument = InstrumentationSettings(tracer_provider=traced.provider)

        result = asyncio.run(agent.run("Where is order 1001?", conversation_id="pa-traced"))
        assert result.output == "done"
        [call] = client.get_agent_snapshot("pa-traced").tool_calls
        assert call.status is CallStatus.SUCCEEDED
        mine = traced.spans()

        # Then call_tool's parent is Pydantic AI's own tool span, in its agent run's trace
        framework = one(mine, "execute_tool lookup_order", **{"gen_ai.tool.call.id": "call-1"})
        run = one(mine, "invoke_agent agent")
        ours = call_under(mine, framework, run, call.key)

        # And the worker's run of the tool is in that trace, under call_tool
        assert_worker_joins(otlp, ours)


# -- the OpenAI Agents SDK, through OpenInference ------------------------------------------------


@contextmanager
def agents_sdk_traced(provider: TracerProvider) -> Iterator[None]:
    """The SDK traces its runs (the other tests of the suite turn that off: offline, the SDK's
    own exporter must not try to send them), into OpenInference's processor alone, which
    stands in for the SDK's exporter until the block ends."""
    bridge = OpenAIAgentsInstrumentor()
    agents.set_tracing_disabled(False)
    bridge.instrument(tracer_provider=provider)
    try:
        yield
    finally:
        bridge.uninstrument()  # puts the SDK's own processors back
        agents.set_tracing_disabled(True)


def test_the_openai_agents_sdks_tool_span_is_the_parent(client: DexClient,
                                                        start_worker: StartWorker) -> None:
    with receiver() as otlp, traced_agent() as traced, agents_sdk_traced(traced.provider):
        start_worker(extra_env=otlp.env())
        # Given an Agents SDK agent whose traces OpenInference turns into OpenTelemetry spans,
        # its tools built from the catalog
        model = ScriptedModel([
            [function_call("lookup_order", {"order_id": "1001"}, call_id="call-1")],
            [assistant_message("done")],
        ])
        agent = agents.Agent(name="support", model=model,
                             tools=dex_function_tools(client, ["lookup_order"]))

        result = asyncio.run(agents.Runner.run(agent, "Where is order 1001?",
                                               context=dex_context("oa-traced", "t1")))
        assert result.final_output == "done"
        [call] = client.get_agent_snapshot("oa-traced").tool_calls
        assert call.status is CallStatus.SUCCEEDED
        mine = traced.spans()

        # Then call_tool's parent is the SDK's function span, in its agent's trace
        framework = one(mine, "lookup_order", **{"openinference.span.kind": "TOOL"})
        run = one(mine, "support", **{"openinference.span.kind": "AGENT"})
        ours = call_under(mine, framework, run, call.key)

        # And the worker's run of the tool is in that trace, under call_tool
        assert_worker_joins(otlp, ours)


# -- LangChain / LangGraph, through Traceloop's instrumentation ----------------------------------


@pytest.mark.parametrize("how", ["middleware", "tool-node"])
def test_langchains_tool_span_is_the_parent(client: DexClient, start_worker: StartWorker,
                                            env: dict[str, str], how: str) -> None:
    thread = f"lc-traced-{how}"
    with receiver() as otlp:
        start_worker(extra_env=otlp.env())
        # Given an agent process tracing its create_agent graph with Traceloop's LangChain
        # instrumentation, exporting OTLP here: its calls run by DexMiddleware (which reports
        # each to LangChain's callbacks as a tool run) or, awaited, by the catalog's tools
        # themselves in LangGraph's tool node (tests/langchain_traced_agent.py)
        done = subprocess.run(
            [sys.executable, "-m", "tests.langchain_traced_agent", thread, how], cwd=ROOT,
            env={**env, **otlp.env()}, capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == "done"
        [call] = client.get_agent_snapshot(thread).tool_calls
        assert call.status is CallStatus.SUCCEEDED
        mine = [s for s in otlp.spans if s.service == "agent"]

        # Then call_tool's parent is LangChain's tool run, in the graph's trace
        framework = one(mine, "execute_tool lookup_order", **{"traceloop.span.kind": "tool"})
        run = one(mine, "invoke_agent LangGraph")
        ours = call_under(mine, framework, run, call.key)

        # And the worker's run of the tool is in that trace, under call_tool
        assert_worker_joins(otlp, ours)
