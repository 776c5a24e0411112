"""OpenTelemetry spans of migrations: one per migration and side, a child per stage.

The source opens ``migration`` (attributes: migration id, request, source,
destination, and at the end outcome, stages, bytes, agent-side downtime) and a
``migration.stage`` child per copied stage (stage, blocks, bytes, duration).
The destination opens ``migration.destination`` as a child of the source's
span, whose context travels in the NATS headers of the handshake messages
(:mod:`bus.tracing`), so both agents' spans join one trace. The provider is
built at the entry point from the ``OTEL_*`` variables (:mod:`bus.telemetry`).

:class:`RequestSpans` keeps the request's own spans (``generate`` with
``queue``/``prefill``/``decode`` children), parented on the trace context of
the generate RPC's headers, so the frontend's, the scheduler's and the
agents' spans are one trace; a migration's ``migration`` span is a child of
the request's ``generate`` span on the source.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer
from opentelemetry.util.types import AttributeValue

from bus import tracing as bus_tracing

__all__ = ["RequestSpans", "headers_for", "parent_context", "tracer_from"]

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


class _Traced:
    __slots__ = ("accepted_ns", "first_output_ns", "span")

    def __init__(self, span: Span, accepted_ns: int) -> None:
        self.span = span
        self.accepted_ns = accepted_ns
        self.first_output_ns: int | None = None  # the first token made here (decode starts then)


class RequestSpans:
    """The agent's spans of the requests it runs: a ``generate`` span each, no span per token.

    A request whose generate RPC carried a trace context (or that migrated in
    under a traced migration) gets a ``generate`` span from acceptance to
    finish, abort or migration away, with a ``queue`` child (accepted → the
    step that produced its first token started), a ``prefill`` child (that
    step) and a ``decode`` child (first token → end), and events
    ``first_token``, ``preempted`` and ``finish``. Untraced requests cost one
    dict lookup per output while some request is traced, nothing otherwise.
    """

    def __init__(self, tracer: Tracer, instance_id: str) -> None:
        self.tracer = tracer
        self.instance_id = instance_id
        self._traced: dict[str, _Traced] = {}
        self._step_started_ns = 0

    def __bool__(self) -> bool:
        return bool(self._traced)

    def open(self, request_id: str, parent: Context, attributes: Mapping[str, AttributeValue]) -> None:
        """Start ``request_id``'s span under ``parent`` (nothing if ``parent`` holds no span)."""
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return
        old = self._traced.pop(request_id, None)
        if old is not None:
            old.span.end()
        span = self.tracer.start_span(
            "generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"shoal.request.id": request_id, "shoal.instance": self.instance_id, **attributes},
        )
        self._traced[request_id] = _Traced(span, time.time_ns())

    def context(self, request_id: str) -> Context | None:
        """The context of ``request_id``'s span (to parent a migration on), or None if untraced."""
        traced = self._traced.get(request_id)
        return None if traced is None else trace.set_span_in_context(traced.span)

    def step_started(self) -> None:
        if self._traced:
            self._step_started_ns = time.time_ns()

    def output(self, request_id: str, first_index: int, num_tokens: int, finish: str | None) -> None:
        """One step's output of ``request_id`` (call only while ``bool(self)``)."""
        traced = self._traced.get(request_id)
        if traced is None:
            return
        now = time.time_ns()
        if traced.first_output_ns is None and num_tokens:
            traced.first_output_ns = now
            started = max(self._step_started_ns, traced.accepted_ns)
            parent = trace.set_span_in_context(traced.span)
            queue = self.tracer.start_span("queue", context=parent, start_time=traced.accepted_ns)
            queue.end(end_time=started)
            # a request resumed here (rescued with tokens, or migrated in) recomputes or continues
            first_step = "prefill" if first_index == 0 else "resume"
            self.tracer.start_span(first_step, context=parent, start_time=started).end(end_time=now)
            traced.span.add_event("first_token", {"shoal.token_index": first_index}, timestamp=now)
        if finish is not None:
            self.close(request_id, finish=finish)

    def preempted(self, request_id: str) -> None:
        traced = self._traced.get(request_id)
        if traced is not None:
            traced.span.add_event("preempted")

    def close(
        self,
        request_id: str,
        *,
        finish: str | None = None,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """End ``request_id``'s span: finished (``finish``), aborted, or moved away (``attributes``)."""
        traced = self._traced.pop(request_id, None)
        if traced is None:
            return
        now = time.time_ns()
        span = traced.span
        if traced.first_output_ns is not None:
            self.tracer.start_span(
                "decode", context=trace.set_span_in_context(span), start_time=traced.first_output_ns
            ).end(end_time=now)
        if attributes:
            span.set_attributes(attributes)
        if finish is not None:
            span.set_attribute("shoal.finish_reason", finish)
            span.add_event("finish", {"shoal.finish_reason": finish}, timestamp=now)
        span.end(end_time=now)

    def close_all(self) -> None:
        for request_id in list(self._traced):
            self.close(request_id, attributes={"shoal.ended_by": "agent_stop"})
