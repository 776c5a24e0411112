"""OpenTelemetry spans of migrations: one per migration and side, a child per stage.

The source opens ``migration`` (attributes: migration id, request, source,
destination, and at the end outcome, stages, bytes, agent-side downtime) and a
``migration.stage`` child per copied stage (stage, blocks, bytes, duration).
The destination opens ``migration.destination`` as a child of the source's
span, whose context travels in the NATS headers of the handshake messages
(:mod:`bus.tracing`), so both agents' spans join one trace. The provider is
built at the entry point from the ``OTEL_*`` variables (:mod:`bus.telemetry`).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer

from bus import tracing as bus_tracing

__all__ = ["headers_for", "parent_context", "tracer_from"]

def tracer_from(provider: trace.TracerProvider | None) -> Tracer:
    """The agent's tracer from ``provider`` (default: the global one, a no-op unless configured)."""
    if provider is None:
        return trace.get_tracer("shoal.agent")
    return provider.get_tracer("shoal.agent")


def headers_for(span: Span | None) -> dict[str, str]:
    """NATS headers carrying ``span``'s trace context (empty without a span)."""
    if span is None:
        return {}
    return dict(bus_tracing.inject({}, context=trace.set_span_in_context(span)))


def parent_context(headers: Mapping[str, str] | None) -> Context:
    return bus_tracing.extract(headers)
