"""A worker's spans of each delivery of a call (see ``tracing.py`` for the whole trace).

Celery's ``task_prerun`` / ``task_postrun`` signals open and close the delivery's ``process``
span (the parent is the message's ``traceparent`` header: the agent's ``call_tool`` span), with
the ``queue_wait`` span before it. The task bodies add three marks: :func:`claimed` after the
claims (the ``claim`` span, from the delivery's start), :func:`run_tool` around the tool (the
``execute_tool`` span, current while the tool runs, so the tool's own instrumented clients
nest under it), and :func:`ended` once the attempt's end is recorded (the ``end`` span).

A child killed while its tool runs exports nothing of that delivery (its spans were open); the
next delivery, or the sweep that ends the call, is in the trace as usual.
"""

from __future__ import annotations

import contextvars
import importlib.util
import time
from typing import TYPE_CHECKING, Any

from dex_tasks import tracing
from dex_tasks.broker.celery_app import tool_of_shadow

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["claimed", "ended", "install", "run_tool"]

_CALL_TASKS = frozenset({"dex.call_tool", "dex.call_single_attempt_tool"})


class _Delivery:
    """The open spans of the delivery a task body is running."""

    __slots__ = ("content", "key", "mark", "process", "started", "token", "tool")

    def __init__(self, process: Span, key: str, tool: str, started: int, content: bool) -> None:
        self.process = process
        self.key = key
        self.tool = tool
        self.started = started
        self.mark = started  # when the last span of the delivery ended
        self.content = content
        self.token: Any = None


_DELIVERY: contextvars.ContextVar[_Delivery | None] = contextvars.ContextVar(
    "dex_delivery", default=None)


def install(app: Any) -> None:
    """Connect the delivery spans to ``app``'s worker; nothing when OpenTelemetry is not
    installed (its spans then cost no signal at all)."""
    if importlib.util.find_spec("opentelemetry") is None:
        return
    from celery import signals

    def started(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) in _CALL_TASKS and tracing.tracer() is not None:
            _start(sender)

    def returned(sender: Any = None, state: str | None = None, **_: Any) -> None:
        if _DELIVERY.get() is not None:
            _finish(state)

    def child_exits(**_: Any) -> None:
        # A prefork child exits without atexit hooks: hand over what its processor holds.
        from opentelemetry import trace

        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush()

    signals.task_prerun.connect(started, weak=False)
    signals.task_postrun.connect(returned, weak=False)
    signals.worker_process_shutdown.connect(child_exits, weak=False)
    app.dex_trace_content = bool(getattr(app.dex_settings, "trace_tool_content", False))


def _start(task: Any) -> None:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    tracer = tracing.tracer()
    assert tracer is not None
    request = task.request
    now = time.time_ns()
    key = str(request.args[0]) if request.args else ""
    # The shadow name says which tool (``dex.call_tool[lookup_order]``) before the claim reads
    # the call; the claim sets it from the call itself.
    tool = tool_of_shadow(getattr(request, "shadow", None)) or "call"
    headers = request.headers or {}
    parent = tracing.parent_context(headers.get(tracing.TRACEPARENT)
                                    or getattr(request, tracing.TRACEPARENT, None))
    queue = (request.delivery_info or {}).get("routing_key") or ""
    sent = headers.get(tracing.SENT_AT) or getattr(request, tracing.SENT_AT, None)
    due = _eta_ns(request.eta)
    waited_from = due if due is not None else (_ns(sent) if sent else None)
    messaging = {"messaging.system": "celery", "messaging.destination.name": queue,
                 "messaging.message.id": str(request.id or ""), "dex.idempotency_key": key}
    if waited_from is not None and waited_from < now:
        wait = tracer.start_span(f"queue_wait {tool}", context=parent, start_time=waited_from,
                                 attributes=messaging)
        wait.end(end_time=now)
    process = tracer.start_span(f"process {tool}", context=parent, kind=SpanKind.CONSUMER,
                                start_time=now, attributes={
                                    **messaging, "messaging.operation.type": "process",
                                    "dex.delivery.redelivered": bool(
                                        (request.delivery_info or {}).get("redelivered")),
                                    "dex.delivery.retries": int(request.retries or 0)})
    delivery = _Delivery(process, key, tool, now,
                         bool(getattr(task.app, "dex_trace_content", False)))
    delivery.token = otel_context.attach(trace.set_span_in_context(process))
    _DELIVERY.set(delivery)


def _finish(state: str | None) -> None:
    from opentelemetry import context as otel_context

    delivery = _DELIVERY.get()
    assert delivery is not None
    _DELIVERY.set(None)
    delivery.process.set_attribute("dex.delivery.state", state or "")
    delivery.process.end()
    otel_context.detach(delivery.token)


def claimed(claim: Any) -> None:
    """After the claims: the ``claim`` span, and the delivery's spans named after the call
    (``claim`` is the claimed call, or what ended the delivery without one)."""
    delivery = _DELIVERY.get()
    if delivery is None:
        return
    now = time.time_ns()
    call = claim[0] if isinstance(claim, tuple) else None
    tracer = tracing.tracer()
    assert tracer is not None
    attributes: dict[str, Any] = {"dex.claimed": call is not None}
    if call is not None:
        delivery.tool = call.tool
        attributes.update(_call_attributes(call))
        delivery.process.update_name(f"process {call.tool}")
        delivery.process.set_attributes(attributes)
    else:
        status = getattr(claim, "status", None)
        why = "duplicate" if claim is None else (getattr(claim, "why", "") or "not claimed")
        attributes["dex.claim.result"] = why
        if status is not None:
            attributes["dex.outcome"] = status.value
            delivery.process.set_attribute("dex.outcome", status.value)
    span = tracer.start_span(f"claim {delivery.tool}", start_time=delivery.started,
                             attributes={"dex.idempotency_key": delivery.key, **attributes})
    span.end(end_time=now)
    delivery.mark = now


def run_tool(call: Any, attempt: int, tool: Any, context: Any, arguments: dict[str, Any]) -> Any:
    """``tool(context, **arguments)`` inside the ``execute_tool {tool}`` span when the
    delivery is traced (its arguments and result only with ``DEX_TRACE_TOOL_CONTENT``)."""
    delivery = _DELIVERY.get()
    if delivery is None:
        return tool(context, **arguments)
    from opentelemetry import trace

    tracer = tracing.tracer()
    assert tracer is not None
    attributes = {**_call_attributes(call), "gen_ai.operation.name": "execute_tool",
                  "gen_ai.tool.type": "function", "dex.attempt": attempt}
    if delivery.content:
        attributes["gen_ai.tool.call.arguments"] = _json(arguments)
    span = tracer.start_span(f"execute_tool {call.tool}", attributes=attributes)
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            value = tool(context, **arguments)
    except BaseException as err:
        tracing.mark_failed(span, err)
        raise
    else:
        if delivery.content:
            span.set_attribute("gen_ai.tool.call.result", _json(value))
        return value
    finally:
        span.end()
        delivery.mark = time.time_ns()


def ended(outcome: Any) -> None:
    """After the attempt's end is recorded: the ``end`` span (from the tool's return) with
    the outcome, which the ``process`` span carries too."""
    delivery = _DELIVERY.get()
    if delivery is None:
        return
    tracer = tracing.tracer()
    assert tracer is not None
    status = getattr(outcome, "status", None)
    value = status.value if status is not None else (getattr(outcome, "why", "") or "none")
    span = tracer.start_span(f"end {delivery.tool}", start_time=delivery.mark,
                             attributes={"dex.idempotency_key": delivery.key,
                                         "dex.outcome": value})
    if status is not None and status.value in ("failed", "outcome_unknown"):
        _status_error(span, value)
        _status_error(delivery.process, value)
    span.end()
    delivery.process.set_attribute("dex.outcome", value)


def _call_attributes(call: Any) -> dict[str, Any]:
    return {**tracing.call_attributes(call.key, call.session_id, call.turn_id,
                                      call.tool_call_id, call.tool),
            "dex.effect": call.effect, "dex.attempt": int(call.attempts)}


def _status_error(span: Span, outcome: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", outcome)
    span.set_status(Status(StatusCode.ERROR, outcome))


def _json(value: Any) -> str:
    import json

    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _ns(seconds: float) -> int:
    return int(float(seconds) * 1e9)


def _eta_ns(eta: Any) -> int | None:
    if not eta:
        return None
    from datetime import datetime

    try:
        return int(datetime.fromisoformat(str(eta)).timestamp() * 1e9)
    except ValueError:
        return None
