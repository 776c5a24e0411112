"""OpenTelemetry spans of migrations: one per migration and side, a child per stage.

The source opens ``migration`` (attributes: migration id, request, source,
destination, and at the end outcome, stages, bytes, agent-side downtime) and a
``migration.stage`` child per copied stage (stage, blocks, bytes, duration).
The destination opens ``migration.destination`` as a child of the source's
span, whose context travels in the NATS headers of the handshake messages
(:mod:`bus.tracing`), so both agents' spans join one trace.
:func:`configure_tracing` builds a tracer provider for the CLI: OTLP if the
exporter package is installed and an endpoint is given, otherwise none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, Tracer

from bus import tracing as bus_tracing

__all__ = ["configure_tracing", "headers_for", "parent_context", "tracer_from"]

log = logging.getLogger(__name__)


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


def configure_tracing(service_name: str, otlp_endpoint: str | None) -> TracerProvider | None:
    """A provider exporting to ``otlp_endpoint`` over OTLP/gRPC, or None when not asked / not installed."""
    if not otlp_endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("--otlp-endpoint given but opentelemetry-exporter-otlp is not installed; no tracing")
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    return provider
