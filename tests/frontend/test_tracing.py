"""The frontend's server span per HTTP request, and ``shoal up``'s tracing environment."""

from __future__ import annotations

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from frontend import tracing
from frontend.tracing import TracingMiddleware
from frontend.up import child_environment

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


async def _stream(request: Request) -> StreamingResponse:
    async def body():  # type: ignore[no-untyped-def]
        tracing.mark({"request.id": "r1"})
        yield b"a"
        tracing.event("first_token")
        yield b"b"

    return StreamingResponse(body())


async def _health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def test_a_request_gets_one_server_span_continuing_the_callers_traceparent() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = Starlette(routes=[Route("/v1/completions", _stream, methods=["POST"]), Route("/health", _health)])
    traced = TracingMiddleware(app, provider)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=traced), base_url="http://t") as client:
        response = await client.post(
            "/v1/completions", headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        )
        assert response.text == "ab"
        assert (await client.get("/health")).status_code == 200
    spans = exporter.get_finished_spans()
    assert [span.name for span in spans] == ["POST /v1/completions"]  # probes are not traced
    span = spans[0]
    assert format(span.context.trace_id, "032x") == CALLER_TRACE
    assert span.parent is not None and format(span.parent.span_id, "016x") == CALLER_SPAN
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["shoal.request.id"] == "r1"  # the streamed body ran inside the span
    assert [event.name for event in span.events] == ["first_token"]
    provider.shutdown()


def test_shoal_up_passes_otel_through_and_otlp_endpoint_sets_the_standard_variable() -> None:
    assert child_environment({"OTEL_SERVICE_NAME": "x"}, None) is None  # inherited as is
    env = child_environment({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "PATH": "/bin"}, "http://j:4317")
    assert env == {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "PATH": "/bin",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317"}
