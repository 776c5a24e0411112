"""Tracing configured the standard way: a ``TracerProvider`` from the ``OTEL_*`` environment.

Every ``shoal`` entry point (``agent``, ``scheduler``, ``serve``, ``up``) reads
its environment once into a frozen :class:`TelemetryConfig`
(:meth:`TelemetryConfig.from_env`) and builds its provider with
:func:`tracer_provider`; nothing below the entry point reads the environment.
The variables are OpenTelemetry's own:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
  used as given) — without one, and without ``OTEL_TRACES_EXPORTER=otlp``,
  tracing is off and costs nothing (no provider: the API's no-op tracer);
* ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``…_TRACES_PROTOCOL``: ``http/protobuf``
  (default) or ``grpc``; ``OTEL_EXPORTER_OTLP_HEADERS`` is passed on;
* ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``;
* ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``;
* ``OTEL_SDK_DISABLED=true`` turns it all off.

Lives in the bus because every component may import the bus. Spans themselves
are started by the components; the trace context travels in NATS headers
(:mod:`bus.tracing`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

__all__ = ["OTLP_PROTOCOLS", "TelemetryConfig", "tracer_provider"]

log = logging.getLogger(__name__)

OTLP_PROTOCOLS = ("http/protobuf", "grpc")


def _parse_pairs(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (W3C baggage style, as the OTel spec writes resource attributes and headers)."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs[key.strip()] = value.strip()
    return pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class TelemetryConfig:
    """What the ``OTEL_*`` variables ask for; ``enabled`` False means no provider at all."""

    enabled: bool = False
    #: the traces endpoint itself (for http/protobuf already ending in ``/v1/traces``)
    endpoint: str = ""
    protocol: str = "http/protobuf"
    headers: tuple[tuple[str, str], ...] = ()
    service_name: str | None = None
    resource_attributes: tuple[tuple[str, str], ...] = ()
    sampler: str = "parentbased_always_on"
    sampler_arg: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TelemetryConfig:
        """Read the standard variables from ``environ`` (an entry point passes ``os.environ``)."""
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporter == "none":
            return cls()
        protocol = (
            environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        ).strip().lower()
        if protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: shoal speaks {OTLP_PROTOCOLS}")
        traces_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        if not traces_endpoint and not base and exporter != "otlp":
            return cls()
        if traces_endpoint:
            endpoint = traces_endpoint
        else:
            base = base or ("http://localhost:4318" if protocol == "http/protobuf" else "http://localhost:4317")
            endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
        attributes = _parse_pairs(environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        return cls(
            enabled=True,
            endpoint=endpoint,
            protocol=protocol,
            headers=tuple(sorted(_parse_pairs(environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")).items())),
            service_name=environ.get("OTEL_SERVICE_NAME", "").strip() or None,
            resource_attributes=tuple(sorted(attributes.items())),
            sampler=environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on",
            sampler_arg=environ.get("OTEL_TRACES_SAMPLER_ARG"),
        )

    def build_sampler(self) -> Sampler:
        ratio = 1.0
        if self.sampler_arg:
            try:
                ratio = float(self.sampler_arg)
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number; using 1.0", self.sampler_arg)
        samplers: dict[str, Sampler] = {
            "always_on": ALWAYS_ON,
            "always_off": ALWAYS_OFF,
            "traceidratio": TraceIdRatioBased(ratio),
            "parentbased_always_on": DEFAULT_ON,
            "parentbased_always_off": DEFAULT_OFF,
            "parentbased_traceidratio": ParentBased(TraceIdRatioBased(ratio)),
        }
        if self.sampler not in samplers:
            log.warning("OTEL_TRACES_SAMPLER=%r is not known; using parentbased_always_on", self.sampler)
        return samplers.get(self.sampler, DEFAULT_ON)

    def build_resource(self, default_service_name: str, instance_id: str | None = None) -> Resource:
        attributes: dict[str, str] = {"service.name": default_service_name}
        if instance_id:
            attributes["service.instance.id"] = instance_id
        attributes.update(self.resource_attributes)
        if self.service_name:
            attributes["service.name"] = self.service_name
        return Resource(attributes)


def _exporter(config: TelemetryConfig) -> SpanExporter:
    headers = dict(config.headers) or None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(
            endpoint=config.endpoint, insecure=not config.endpoint.startswith("https://"), headers=headers
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.endpoint, headers=headers)


def tracer_provider(
    config: TelemetryConfig, default_service_name: str, *, instance_id: str | None = None
) -> TracerProvider | None:
    """A provider exporting over OTLP as ``config`` says, or None when tracing is off.

    ``default_service_name`` (``shoal-agent``, ``shoal-scheduler``, ``shoal-frontend``) yields to
    ``OTEL_SERVICE_NAME``; ``instance_id`` becomes ``service.instance.id`` (an agent's instance id,
    a scheduler's lease-holder id). The caller owns the provider: ``provider.shutdown()`` at exit
    flushes the last spans.
    """
    if not config.enabled:
        return None
    provider = TracerProvider(
        resource=config.build_resource(default_service_name, instance_id), sampler=config.build_sampler()
    )
    provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    log.info("tracing: OTLP %s to %s", config.protocol, config.endpoint)
    return provider
