"""The OTLP/HTTP receiver takes what shoal's exporter sends: spans decoded, counted, and refusals counted."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from bus.otlp_receiver import OtlpReceiver, ReceiverProcess, fetch_stats
from bus.telemetry import TelemetryConfig, tracer_provider


def _two_spans(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer") as outer:
        outer.set_attribute("shoal.request.id", "r1")
        with tracer.start_as_current_span("inner") as inner:
            inner.add_event("first_token")
    provider.shutdown()  # flushes


def test_spans_from_shoals_exporter_arrive_decoded_with_parents_service_and_attributes() -> None:
    with OtlpReceiver(keep_spans=True) as receiver:
        config = TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
        provider = tracer_provider(config, "shoal-test", instance_id="i0")
        assert provider is not None
        _two_spans(provider)
        stats = fetch_stats(receiver.url)
        spans = {span.name: span for span in receiver.spans}
    assert stats.spans == 2 and stats.exports >= 1 and stats.bytes > 0 and stats.rejected == 0
    assert stats.spans_by_name == {"outer": 1, "inner": 1}
    assert spans["inner"].parent_id == spans["outer"].span_id and spans["outer"].parent_id == ""
    assert spans["inner"].trace_id == spans["outer"].trace_id
    assert spans["outer"].service == "shoal-test/i0"
    assert spans["outer"].attributes == {"shoal.request.id": "r1"}
    assert spans["inner"].events == ("first_token",)


def test_gzip_bodies_are_decoded_and_what_is_no_trace_export_is_refused() -> None:
    with OtlpReceiver() as receiver:
        provider = TracerProvider(resource=Resource({"service.name": "gz"}))
        exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces", compression=Compression.Gzip)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _two_spans(provider)
        statuses = []
        for path, content_type, body in [
            ("/v1/traces", "application/x-protobuf", b"\xff\xff not protobuf"),
            ("/v1/traces", "application/json", b"{}"),
            ("/v1/logs", "application/x-protobuf", b""),
        ]:
            request = urllib.request.Request(
                f"{receiver.url}{path}", data=body, method="POST", headers={"Content-Type": content_type}
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5).close()
            statuses.append(refused.value.code)
            refused.value.close()
        stats = receiver.stats()
    assert stats.spans == 2 and stats.spans_by_name == {"outer": 1, "inner": 1}
    assert statuses == [400, 415, 404] and stats.rejected == 3


def test_the_receiver_process_counts_spans_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    with ReceiverProcess(tmp_path / "receiver.log") as receiver:
        provider = tracer_provider(
            TelemetryConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}), "shoal-test"
        )
        assert provider is not None
        _two_spans(provider)
        assert receiver.stats().spans == 2
    assert receiver.process is not None and receiver.process.returncode == 0
    assert '"spans":2' in (tmp_path / "receiver.log").read_text()
