"""The tracer provider every entry point builds from the standard ``OTEL_*`` variables."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from bus.telemetry import TelemetryConfig, tracer_provider


def test_without_an_endpoint_tracing_is_off_and_there_is_no_provider() -> None:
    config = TelemetryConfig.from_env({"OTEL_SERVICE_NAME": "x", "PATH": "/bin"})
    assert not config.enabled
    assert tracer_provider(config, "shoal-agent") is None


def test_an_endpoint_turns_on_http_protobuf_to_its_traces_path() -> None:
    config = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
    assert config.enabled
    assert config.protocol == "http/protobuf"
    assert config.endpoint == "http://collector:4318/v1/traces"


def test_grpc_and_a_traces_endpoint_are_used_as_given() -> None:
    grpc = TelemetryConfig.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert (grpc.protocol, grpc.endpoint) == ("grpc", "http://jaeger:4317")
    traces = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/custom"})
    assert traces.endpoint == "http://c:9/custom"


def test_an_unknown_protocol_is_an_error_not_silence() -> None:
    with pytest.raises(ValueError, match="http/json"):
        TelemetryConfig.from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )


@pytest.mark.parametrize("variables", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_standard_switches_turn_it_off(variables: dict[str, str]) -> None:
    assert not TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **variables}).enabled


def test_service_name_resource_attributes_and_sampler_come_from_the_environment() -> None:
    config = TelemetryConfig.from_env({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.name=ignored",
        "OTEL_SERVICE_NAME": "agent-7",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    })
    provider = tracer_provider(config, "shoal-agent")
    assert isinstance(provider, TracerProvider)
    try:
        attributes = provider.resource.attributes
        assert attributes["service.name"] == "agent-7"
        assert attributes["deployment.environment"] == "test"
        assert "0.25" in provider.sampler.get_description()
    finally:
        provider.shutdown()


def test_the_default_service_name_is_the_components() -> None:
    config = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    provider = tracer_provider(config, "shoal-scheduler", instance_id="scheduler-a")
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "shoal-scheduler"
        assert provider.resource.attributes["service.instance.id"] == "scheduler-a"
    finally:
        provider.shutdown()


def test_grpc_exports_reach_a_real_otlp_grpc_receiver() -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: spans arrive at an OTLP/gRPC TraceService (Jaeger's :4317)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            received.extend(
                span.name
                for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            )
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        config = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
        provider = tracer_provider(config, "shoal-agent")
        assert provider is not None
        provider.get_tracer("test").start_span("generate").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
        assert received == ["generate"]
    finally:
        server.stop(None)
