"""OpenTelemetry traces of tool calls across real processes (issue 31 item 3).

The agent is this test process (the SDK's in-memory exporter); the worker, the API and the
deadline sweep are `dex-tasks` subprocesses that export OTLP/HTTP, from the `OTEL_*` variables
alone, to a receiver in this test (tests/otel.py). Every span of a call must join the agent's
trace, under the agent's own span, whichever process made it and however much later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from dex_tasks import CallStatus, DexClient
from dex_tasks.tokens import issue_token
from tests.browser import SECRET, api_process
from tests.conftest import StartWorker
from tests.helpers import dex_command, wait_until
from tests.otel import Receiver, Span, one, receiver, traced_agent

SESSION = "traced-session"


@pytest.fixture
def otlp() -> Receiver:
    with receiver() as r:
        yield r  # type: ignore[misc]


def _of_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id]


def test_a_call_is_one_trace_from_the_agent_span_to_the_tool_run(
    client: DexClient, start_worker: StartWorker, otlp: Receiver,
) -> None:
    # Given a worker subprocess exporting OTLP (OTEL_* variables only) and an agent process
    # tracing in memory, with a span of its own open (a model step)
    start_worker(extra_env=otlp.env())
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="c1",
                                      tool="lookup_order", arguments={"order_id": "1001"})
        assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED
        trace_id = f"{step.get_span_context().trace_id:032x}"
        step_id = f"{step.get_span_context().span_id:016x}"
        mine = agent.spans()

    # Then call_tool's span is a child of the agent's span, with GenAI's attributes
    call_span = one(mine, "call_tool lookup_order")
    assert (call_span.trace_id, call_span.parent_id) == (trace_id, step_id)
    assert call_span.attributes["gen_ai.tool.name"] == "lookup_order"
    assert call_span.attributes["gen_ai.tool.call.id"] == "c1"
    assert call_span.attributes["dex.idempotency_key"] == record.key
    assert call_span.attributes["dex.effect"] == "read"
    # and its context is the call's record
    stored = client.store.get_call(record.key)
    assert stored is not None
    assert stored.trace_context is not None
    assert stored.trace_context.startswith(f"00-{trace_id}-{call_span.span_id}-")

    # And the worker's spans (another process) join that trace under call_tool
    def worker_spans() -> list[Span] | None:
        # Until `process`: it ends after its children, so it is exported last (the batch
        # processor may send `end` in one export and `process` in the next).
        spans = _of_trace(otlp.spans, trace_id)
        return spans if any(s.name == "process lookup_order" for s in spans) else None

    theirs = wait_until(worker_spans, 30, "the worker's spans")
    assert {s.service for s in theirs} == {"dex-tasks-worker"}
    wait = one(theirs, "queue_wait lookup_order")
    process = one(theirs, "process lookup_order")
    assert wait.parent_id == process.parent_id == call_span.span_id
    assert wait.end <= process.start + 1_000_000
    assert process.attributes["messaging.destination.name"] == "dex.tool.lookup_order"
    for name in ("claim lookup_order", "execute_tool lookup_order", "end lookup_order"):
        assert one(theirs, name).parent_id == process.span_id, name
    run = one(theirs, "execute_tool lookup_order")
    assert run.attributes["gen_ai.operation.name"] == "execute_tool"
    assert run.attributes["gen_ai.tool.name"] == "lookup_order"
    assert run.attributes["gen_ai.tool.call.id"] == "c1"
    assert run.attributes["dex.effect"] == "read"
    assert run.attributes["dex.attempt"] == 1
    assert run.attributes["dex.idempotency_key"] == record.key
    # never the arguments or the result unless DEX_TRACE_TOOL_CONTENT asks
    assert not any(k.startswith(("gen_ai.tool.call.arguments", "gen_ai.tool.call.result"))
                   or "shipped" in str(v) for s in theirs + mine for k, v in s.attributes.items())
    assert one(theirs, "end lookup_order").attributes["dex.outcome"] == "succeeded"
    assert process.attributes["dex.outcome"] == "succeeded"
    assert not any(s.error for s in theirs)


def test_an_approval_decided_later_by_the_api_joins_the_agents_trace(
    client: DexClient, start_worker: StartWorker, otlp: Receiver, env: dict[str, str],
    tmp_path: Path,
) -> None:
    # Given a call that needs approval, requested under the agent's span; the agent's spans end
    # and its tracing stops (the agent process could exit: nothing of it is needed later)
    start_worker(extra_env=otlp.env())
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="r1",
                                      tool="refund_payment",
                                      arguments={"charge_id": "ch_1", "amount_cents": 500})
        trace_id = f"{step.get_span_context().trace_id:032x}"
        mine = agent.spans()
        call_span = one(mine, "call_tool refund_payment")
    assert record.status is CallStatus.AWAITING_APPROVAL
    assert call_span.attributes["dex.requires_approval"] is True

    # When a person approves it through the API, another process that never saw the agent
    with api_process({**env, **otlp.env()}, tmp_path) as api:
        token = issue_token(SECRET, SESSION, approver="alice")
        answer = httpx.post(f"{api.url}/interrupts/resolve", timeout=10,
                            headers={"Authorization": f"Bearer {token}"},
                            json={"interrupt_id": record.interrupt_id, "approved": True})
        assert answer.json() == {"accepted": True}, answer.text
        assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED

        def all_spans() -> list[Span] | None:
            spans = _of_trace(otlp.spans, trace_id)
            names = {s.name for s in spans}
            return spans if {"decide_approval refund_payment",
                             "process refund_payment"} <= names else None

        theirs = wait_until(all_spans, 30, "the API's and the worker's spans")
    # docs/images/trace-approval.png is rendered from these (python -m bench.waterfall)
    if os.environ.get("DEX_TRACE_DUMP"):
        Path(os.environ["DEX_TRACE_DUMP"]).write_text(json.dumps(
            [dataclasses.asdict(s) for s in [*mine, *theirs]], indent=1))

    # Then the wait and the decision are in the agent's trace, made by the API, with who decided
    waited = one(theirs, "await_approval refund_payment")
    decided = one(theirs, "decide_approval refund_payment")
    assert waited.service == decided.service == "dex-tasks-api"
    assert waited.parent_id == decided.parent_id == call_span.span_id
    assert decided.attributes["dex.approval.decision"] == "approved"
    assert decided.attributes["dex.approval.approver"] == "alice"
    assert waited.start <= decided.start
    assert waited.start == pytest.approx(call_span.start, abs=50_000_000)
    # the decision is linked to the HTTP request's span when the API traces one (none here)
    # And the worker's delivery after the approval joins it too
    process = one(theirs, "process refund_payment")
    assert process.parent_id == call_span.span_id
    assert process.service == "dex-tasks-worker"
    assert process.start >= decided.start
    assert one(theirs, "execute_tool refund_payment").attributes["dex.effect"] == \
        "non_idempotent_write"


def test_a_deadline_decided_by_the_sweep_joins_the_trace(
    client: DexClient, start_worker: StartWorker, otlp: Receiver, env: dict[str, str],
) -> None:
    # Given a traced call whose approval deadline passes undecided
    start_worker()  # publishes the catalog
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            record = client.call_tool(session_id=SESSION, turn_id="t1", tool_call_id="r2",
                                      tool="refund_payment", approval_deadline=0.5,
                                      arguments={"charge_id": "ch_2", "amount_cents": 500})
        call_span = one(agent.spans(), "call_tool refund_payment")
    trace_id = f"{step.get_span_context().trace_id:032x}"
    deadline = record.created_at.timestamp() + 0.5
    wait_until(lambda: time.time() > deadline + 0.1, 10, "the deadline to pass")

    # When `dex-tasks sweep` (another process, as beat) rejects it
    done = subprocess.run([*dex_command(), "sweep"], env={**env, **otlp.env()},
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert client.get_tool_call(record.key).status is CallStatus.REJECTED

    # Then the wait and the deadline's decision are spans of the agent's trace
    spans = wait_until(lambda: _of_trace(otlp.spans, trace_id), 30, "the sweep's spans")
    decided = one(spans, "decide_approval refund_payment")
    assert decided.attributes["dex.approval.decision"] == "expired"
    assert "dex.approval.approver" not in decided.attributes
    assert decided.service == "dex-tasks-sweep"
    assert decided.parent_id == call_span.span_id
    assert one(spans, "await_approval refund_payment").parent_id == call_span.span_id


def test_untraced_calls_carry_no_context(client: DexClient, start_worker: StartWorker) -> None:
    # Given no OpenTelemetry configured in the agent process (the global provider is the API's
    # default): a call stores no trace context and its message has no traceparent
    from dex_tasks import tracing

    assert tracing.tracer() is None
    start_worker()
    record = client.call_tool(session_id=SESSION, turn_id="t2", tool_call_id="c1",
                              tool="lookup_order", arguments={"order_id": "1002"})
    assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED
    stored = client.store.get_call(record.key)
    assert stored is not None and stored.trace_context is None
    assert tracing.message_headers(stored) is None


def test_a_retry_is_another_delivery_in_the_same_trace(
    client: DexClient, start_worker: StartWorker, otlp: Receiver,
) -> None:
    # Given a traced read whose tool fails transiently once (Celery's Task.retry sends the
    # next message: it must keep the trace context)
    start_worker(extra_env=otlp.env())
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            record = client.call_tool(session_id=SESSION, turn_id="t3", tool_call_id="f1",
                                      tool="flaky_lookup",
                                      arguments={"order_id": "1001", "fail_times": 1})
        call_span = one(agent.spans(), "call_tool flaky_lookup")
    assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED
    trace_id = f"{step.get_span_context().trace_id:032x}"

    # Then both deliveries are under call_tool: the first ends queued (a retry), the second
    # succeeds, each with its own attempt
    def two_deliveries() -> list[Span] | None:
        # `process` is each delivery's last span to end, so its last exported
        spans = _of_trace(otlp.spans, trace_id)
        return spans if sum(s.name == "process flaky_lookup" for s in spans) == 2 else None

    spans = wait_until(two_deliveries, 30, "both deliveries' spans")
    runs = sorted((s for s in spans if s.name == "execute_tool flaky_lookup"),
                  key=lambda s: s.start)
    assert [r.attributes["dex.attempt"] for r in runs] == [1, 2]
    assert runs[0].error and runs[0].attributes["error.type"] == "TransientToolError"
    processes = sorted((s for s in spans if s.name == "process flaky_lookup"),
                       key=lambda s: s.start)
    assert [p.parent_id for p in processes] == [call_span.span_id] * 2
    assert [p.attributes["dex.outcome"] for p in processes] == ["queued", "succeeded"]


def test_arguments_and_results_are_recorded_only_when_asked(
    client: DexClient, start_worker: StartWorker, otlp: Receiver,
) -> None:
    # Given a worker with DEX_TRACE_TOOL_CONTENT on
    start_worker(extra_env={**otlp.env(), "DEX_TRACE_TOOL_CONTENT": "true"})
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            record = client.call_tool(session_id=SESSION, turn_id="t4", tool_call_id="c1",
                                      tool="lookup_order", arguments={"order_id": "1002"})
    assert client.wait(record.key, timeout=30).status is CallStatus.SUCCEEDED
    trace_id = f"{step.get_span_context().trace_id:032x}"
    spans = wait_until(lambda: [s for s in _of_trace(otlp.spans, trace_id)
                                if s.name == "execute_tool lookup_order"], 30, "the tool's span")
    # Then the tool's span carries them, as GenAI's conventions name them
    attributes = spans[0].attributes
    assert json.loads(attributes["gen_ai.tool.call.arguments"])["order_id"] == "1002"
    assert json.loads(attributes["gen_ai.tool.call.result"])["status"] == "processing"


def test_call_tools_opens_one_span_per_call(
    client: DexClient, start_worker: StartWorker, otlp: Receiver,
) -> None:
    # Given a turn's two parallel calls recorded at once (one transaction, one publish)
    start_worker(extra_env=otlp.env())
    with traced_agent() as agent:
        with agent.tracer.start_as_current_span("agent step") as step:
            records = client.call_tools(
                [{"tool_call_id": "a", "tool": "lookup_order", "arguments": {"order_id": "1001"}},
                 {"tool_call_id": "b", "tool": "lookup_order",
                  "arguments": {"order_id": "1002"}}],
                session_id=SESSION, turn_id="t5")
        mine = agent.spans()
    assert all(client.wait(r.key, timeout=30).status is CallStatus.SUCCEEDED for r in records)
    step_id = f"{step.get_span_context().span_id:016x}"
    trace_id = f"{step.get_span_context().trace_id:032x}"

    # Then each call has its own call_tool span under the agent's, its own stored context,
    # and its own delivery under it
    spans = {s.attributes["gen_ai.tool.call.id"]: s for s in mine
             if s.name == "call_tool lookup_order"}
    assert sorted(spans) == ["a", "b"]
    assert {s.parent_id for s in spans.values()} == {step_id}
    for record in records:
        stored = client.store.get_call(record.key)
        assert stored is not None and stored.trace_context is not None
        assert stored.trace_context.split("-")[2] == spans[record.tool_call_id].span_id

    def deliveries() -> list[Span] | None:
        found = [s for s in _of_trace(otlp.spans, trace_id) if s.name == "process lookup_order"]
        return found if len(found) == 2 else None

    processes = wait_until(deliveries, 30, "both deliveries")
    assert {p.parent_id for p in processes} == {spans["a"].span_id, spans["b"].span_id}
