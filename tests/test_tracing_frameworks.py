"""A framework's own span is the parent of dex-tasks' spans (issue 31 item 3).

Pydantic AI traces with OpenTelemetry itself (``Agent.instrument``, what Logfire turns on): its
``execute_tool {name}`` span is current while the tool runs, so the call ``DexCapability``
makes there opens ``call_tool`` under it, and the worker's spans follow. Offline, with Pydantic
AI's ``FunctionModel``, against a real ``dex-tasks worker`` exporting OTLP to this test.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

from dex_tasks import CallStatus, DexClient
from dex_tasks.integrations.pydantic_ai import DexCapability
from tests.conftest import StartWorker
from tests.helpers import wait_until
from tests.otel import Span, one, receiver, traced_agent


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
        ours = one(mine, "call_tool lookup_order")
        assert ours.parent_id == framework.span_id
        assert ours.trace_id == framework.trace_id == run.trace_id
        assert ours.attributes["dex.idempotency_key"] == call.key

        # And the worker's run of the tool is in that trace, under call_tool
        def worker_run() -> list[Span] | None:
            spans = [s for s in otlp.spans if s.trace_id == run.trace_id]
            return spans if any(s.name == "end lookup_order" for s in spans) else None

        theirs = wait_until(worker_run, 30, "the worker's spans")
        assert one(theirs, "process lookup_order").parent_id == ours.span_id
        assert one(theirs, "execute_tool lookup_order").service == "dex-tasks-worker"
