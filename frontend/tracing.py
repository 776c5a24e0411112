"""The frontend's spans: one server span per HTTP request, the root of the request's trace.

:class:`TracingMiddleware` (installed by :func:`frontend.app.create_app` only
when a tracer provider is given: off costs nothing) opens a ``SERVER`` span per
HTTP request, continuing the caller's W3C ``traceparent`` header, and keeps it
current until the last byte of the response — a streamed completion included.
The gateway, running inside it, puts the span's context in the NATS headers of
the dispatch and generate RPCs (:mod:`bus.tracing`), so the scheduler's
``dispatch`` span and the agents' spans join the same trace; it marks bypass
placements, rescues and the first token on the current span with
:func:`mark` and :func:`event` (no span per token).
Not here: the provider itself (:mod:`bus.telemetry`), read at ``shoal serve``.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus import tracing as bus_tracing

__all__ = ["TracingMiddleware", "event", "mark"]

#: paths whose requests get no span (probes and scrapes would drown the traces)
UNTRACED_PATHS = frozenset({"/health", "/metrics"})


def mark(attributes: Mapping[str, AttributeValue]) -> None:
    """Set ``shoal.<name>`` attributes on the current span (a no-op without one)."""
    span = trace.get_current_span()
    if span.is_recording():
        for name, value in attributes.items():
            span.set_attribute(f"shoal.{name}", value)


def event(name: str, **attributes: AttributeValue) -> None:
    """Add event ``name`` to the current span (a no-op without one)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, {f"shoal.{key}": value for key, value in attributes.items()})


class TracingMiddleware:
    """A ``SERVER`` span around each HTTP request, parented on the caller's ``traceparent``."""

    def __init__(self, app: ASGIApp, tracer_provider: trace.TracerProvider) -> None:
        self.app = app
        self.tracer = tracer_provider.get_tracer("shoal.frontend")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())
        }
        method, path = scope.get("method", "GET"), scope.get("path", "/")
        span = self.tracer.start_span(
            f"{method} {path}",
            context=bus_tracing.extract(headers),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "http.route": path},
        )
        token = otel_context.attach(trace.set_span_in_context(span))

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR)
            raise
        finally:
            otel_context.detach(token)
            span.end()
