"""OpenTelemetry for the ``dex-tasks`` commands, from OpenTelemetry's own ``OTEL_*`` variables.

A process the user writes (an agent) configures OpenTelemetry itself. The processes dex-tasks
starts (``dex-tasks worker``, ``beat``, ``api``...) have no code of the user's to do it in
before they start, so :func:`configure_from_env` does it from the standard variables, and only
when one of them asks for traces: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, or any
exporter registered under ``opentelemetry_traces_exporter``) or an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). The exporters read
their own variables (endpoint, headers, protocol); ``OTEL_SERVICE_NAME`` names the service
(default ``dex-tasks-<command>``); ``OTEL_BSP_*`` tune the batching. A process configured
otherwise (``opentelemetry-instrument dex-tasks worker ...``, a tools module that sets a
provider) is left as it is.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["configure_from_env"]

_OTLP = {"grpc": "otlp_proto_grpc"}


def wanted() -> list[str]:
    """The exporters the environment asks for (empty: none)."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
             if n.strip()]
    if not names and (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                      or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return [n for n in names if n != "none"]


def configure_from_env(command: str) -> bool:
    """Set a global tracer provider from the ``OTEL_*`` variables when they ask for traces
    and none is set; True if it did. A missing package is one clear error."""
    names = wanted()
    if not names or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as err:
        from dex_tasks.errors import ConfigurationError

        raise ConfigurationError(
            f"OTEL_* variables ask for traces but OpenTelemetry's SDK is not installed "
            f"({err.name}): pip install 'dex-tasks[otel]', or unset OTEL_TRACES_EXPORTER "
            "and OTEL_EXPORTER_OTLP_ENDPOINT") from None
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # configured already (opentelemetry-instrument, sitecustomize...)
    service = os.environ.get("OTEL_SERVICE_NAME") or f"dex-tasks-{command}"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    return True


def _exporter(name: str) -> Any:
    from importlib.metadata import entry_points

    from dex_tasks.errors import ConfigurationError

    if name == "otlp":
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        name = _OTLP.get(protocol, "otlp_proto_http")
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER names {name!r}, which no installed package provides: "
            "pip install 'dex-tasks[otel]' (OTLP over HTTP), or the exporter's package")
    return next(iter(found)).load()()
