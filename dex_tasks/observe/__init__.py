"""Observability that is optional: OpenTelemetry traces (the ``[otel]`` extra)."""
