"""OpenTelemetry spans of a tool call, in every process the call crosses.

Nothing here runs unless OpenTelemetry is installed (the ``[otel]`` extra) and a tracer
provider is configured in the process (``trace.set_tracer_provider``, ``opentelemetry-instrument``,
Logfire, or the ``OTEL_*`` variables a ``dex-tasks`` command reads: ``ops/tracing_setup.py``). Until
then each hook is one check of a module global: no span, no context, no header, no column.

The trace of one call::

    <the caller's span: a framework's tool or model span>     agent process
    └─ call_tool {tool}              PRODUCER: call_tool / call_tools / record_step
       ├─ await_approval {tool}      the wait, from the request to the decision  } the process
       ├─ decide_approval {tool}     the decision itself (who, or the deadline)  } that decides
       ├─ queue_wait {tool}          from the publish (or the retry's due time)  } worker
       └─ process {tool}             CONSUMER: one delivery                      }
          ├─ claim {tool}            the Redis and store claims
          ├─ execute_tool {tool}     the tool's run (GenAI: gen_ai.tool.*)
          └─ end {tool}              recording how the attempt ended

The context of ``call_tool`` is stored with the call (``trace_context``, a W3C traceparent)
and sent in each of its messages (the ``traceparent`` header, as OpenTelemetry's Celery
instrumentation carries it), so a delivery, a retry, a republish and a decision made days
later by another process (the API, beat's deadline sweep) all join the agent's trace.

Attributes follow OpenTelemetry's semantic conventions where they exist (GenAI tool calls:
``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
``gen_ai.conversation.id``; messaging: ``messaging.*``); the rest are ``dex.*``. Arguments and
results are recorded only when ``DEX_TRACE_TOOL_CONTENT`` is on (see ``worker/spans.py``).
"""

from __future__ import annotations

import contextvars
import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

__all__ = [
    "TRACEPARENT",
    "approvals_decided",
    "message_headers",
    "parent_context",
    "request_span",
    "requesting",
    "set_tracer_provider",
    "traced_request",
    "tracer",
]

TRACEPARENT = "traceparent"
"""The W3C header that carries a call's trace context in its Celery messages."""

SENT_AT = "dex_sent_at"
"""The message header with the publish time (epoch seconds): the start of ``queue_wait``."""

_NAME = "dex_tasks"
_F = TypeVar("_F", bound=Callable[..., Any])

# None: not looked up yet, or no provider configured yet (looked up again next time: a process
# may configure OpenTelemetry after importing dex-tasks). False: OpenTelemetry is not installed.
_tracer: Any = None
_provider: TracerProvider | None = None
_trace_api: Any = None  # the opentelemetry.trace module, once imported
# OpenTelemetry's API builds the global provider from this variable on first use.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def set_tracer_provider(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` instead of OpenTelemetry's global one (None: the global again).

    For a process that keeps several providers (tests, a framework configured with its own).
    """
    global _tracer, _provider
    _provider = provider
    _tracer = None


def tracer() -> Tracer | None:
    """dex-tasks' tracer, or None when OpenTelemetry is not installed or not configured.

    Cheap: after the first call, one global read when tracing is off for good (no
    OpenTelemetry) or on (a provider was set); a look at the global provider otherwise.
    """
    global _tracer, _trace_api
    if _tracer is not None:
        return _tracer or None
    trace = _trace_api
    if trace is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _tracer = False
            return None
        _trace_api = trace
    # trace.get_tracer_provider() looks up an environment variable on every call (about 4 µs,
    # a KeyError inside os.environ): while nothing is configured, the API's own global says so
    # for a tenth of that. (If a release renames it, the public call decides, as below.)
    if (_provider is None and getattr(trace, "_TRACER_PROVIDER", False) is None
            and not _PROVIDER_FROM_ENV):
        return None
    provider = _provider or trace.get_tracer_provider()
    # The API's defaults until the process configures a provider: tracing stays off (and is
    # looked up again at the next hook, since a provider may be configured later).
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("dex-tasks")
    except PackageNotFoundError:
        own = None
    _tracer = provider.get_tracer(_NAME, own)
    return _tracer  # type: ignore[no-any-return]


def traceparent(span: Span) -> str | None:
    """The W3C traceparent of ``span`` (None for a span with no valid context)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent_context(traceparent_value: str | None) -> Any:
    """The OpenTelemetry context whose current span is the one ``traceparent_value`` names
    (the call's), or None (a root span then) for none or a malformed one."""
    if not traceparent_value:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent_value})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def message_headers(call: Any) -> dict[str, Any] | None:
    """The headers a call's message carries: its trace context and the publish time, or None
    for a call recorded without tracing (then its message is as it always was)."""
    value = getattr(call, "trace_context", None)
    if value is None:
        return None
    return {TRACEPARENT: value, SENT_AT: time.time()}


# -- the agent process: call_tool / call_tools --------------------------------------------------


class _Requesting:
    """The spans of the calls one ``call_tool`` / ``call_tools`` records; they end with it."""

    __slots__ = ("spans", "token")

    def __init__(self) -> None:
        self.spans: dict[str, Span] = {}
        self.token: contextvars.Token[_Requesting | None] | None = None

    def __enter__(self) -> _Requesting:
        self.token = _REQUESTING.set(self)
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        assert self.token is not None
        _REQUESTING.reset(self.token)
        for span in self.spans.values():
            if err is not None:
                mark_failed(span, err)
            span.end()


class _Off:
    """What the hooks hand out when tracing is off: does nothing, costs one call."""

    __slots__ = ()

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *_: object) -> None:
        return None


OFF = _Off()

_REQUESTING: contextvars.ContextVar[_Requesting | None] = contextvars.ContextVar(
    "dex_requesting", default=None)


def requesting() -> _Requesting | _Off:
    """Around the recording and sending of calls (``call_tool``, ``call_tools``,
    ``record_step``): each call :func:`request_span` opens inside ends when this ends, marked
    failed if it raised."""
    if tracer() is None:
        return OFF
    return _Requesting()


def request_span(key: str, session_id: str, turn_id: str, tool_call_id: str, tool: str,
                 effect: str, requires_approval: bool) -> str | None:
    """Open the ``call_tool {tool}`` span of a call being recorded, under the caller's current
    span, and return its traceparent for the call's record (None when tracing is off)."""
    requesting_now = _REQUESTING.get()
    if requesting_now is None:
        return None
    span = requesting_now.spans.get(key)
    if span is None:
        from opentelemetry.trace import SpanKind

        span = _tracer.start_span(f"call_tool {tool}", kind=SpanKind.PRODUCER, attributes={
            **call_attributes(key, session_id, turn_id, tool_call_id, tool),
            "dex.effect": effect, "dex.requires_approval": requires_approval,
            "messaging.operation.type": "send", "messaging.system": "celery",
        })
        requesting_now.spans[key] = span
    return traceparent(span)


def call_attributes(key: str, session_id: str, turn_id: str, tool_call_id: str,
                    tool: str) -> dict[str, Any]:
    """The attributes every span of a call carries: who it is, in GenAI's terms and ours."""
    return {
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": tool_call_id,
        "gen_ai.conversation.id": session_id,
        "dex.session_id": session_id,
        "dex.turn_id": turn_id,
        "dex.idempotency_key": key,
    }


# -- approvals: a person's decision, or the deadline --------------------------------------------


def approvals_decided(store: Any, keys: list[str], decision: str, approver: str | None,
                      decided_at: float) -> None:
    """Record the wait and the decision of calls just decided (``resolve_interrupt``, the
    deadline sweep) in each call's trace: ``await_approval`` from the request to the decision,
    ``decide_approval`` for the decision itself, linked to the decider's current span (an HTTP
    request's, a sweep's). Reads the calls only when tracing is on, and never fails the
    decision it describes."""
    if tracer() is None or not keys:
        return
    try:
        _approval_spans(store.get_calls(keys), decision, approver, decided_at)
    except Exception:  # a trace is never worth a decision: logged, not raised
        import logging

        logging.getLogger("dex_tasks.tracing").warning(
            "could not record the approval's spans", exc_info=True)


def _approval_spans(calls: Mapping[str, Any], decision: str, approver: str | None,
                    decided_at: float) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import Link

    current = trace.get_current_span().get_span_context()
    links = [Link(current)] if current.is_valid else None
    now = time.time_ns()
    for call in calls.values():
        parent = parent_context(call.trace_context)
        attributes = {
            **call_attributes(call.key, call.session_id, call.turn_id, call.tool_call_id,
                              call.tool),
            "dex.approval.decision": decision,
            "dex.interrupt_id": call.interrupt_id or "",
        }
        if approver:
            attributes["dex.approval.approver"] = approver
        wait = _tracer.start_span(f"await_approval {call.tool}", context=parent,
                                  start_time=_ns(call.created_at), attributes=attributes)
        wait.end(end_time=_ns(decided_at))
        decided = _tracer.start_span(f"decide_approval {call.tool}", context=parent,
                                     start_time=_ns(decided_at), links=links,
                                     attributes={**attributes, "dex.status": call.status})
        decided.end(end_time=max(now, _ns(decided_at)))


# -- shared ------------------------------------------------------------------------------------


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def mark_failed(span: Span, err: BaseException) -> None:
    """Mark ``span`` failed with the error's type only: its text may quote arguments."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(err).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(err).__qualname__))


def traced_request(method: _F) -> _F:
    """Run ``method`` (``call_tool``, ``call_tools``' recording) inside :func:`requesting`."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if tracer() is None:
            return method(*args, **kwargs)
        with _Requesting():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
