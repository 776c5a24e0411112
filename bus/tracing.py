"""W3C trace context in NATS headers, through OpenTelemetry's propagators.

:func:`inject` writes ``traceparent`` (and ``tracestate``/``baggage`` when
present) for the current span, or a given context, into a header dict;
:func:`extract` turns received headers back into an OpenTelemetry context to
parent a span on. Header names are matched case-insensitively, since NATS
preserves whatever case the producer used. The propagator is the W3C one, set
here rather than read from the environment. The bus never starts spans itself.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["TRACEPARENT", "extract", "header", "inject", "traceparent"]

TRACEPARENT = "traceparent"

_propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


def header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """The value of header ``name`` in any letter case, or None."""
    if not headers:
        return None
    value = headers.get(name)
    if value is not None:
        return value
    wanted = name.lower()
    for key, candidate in headers.items():
        if key.lower() == wanted:
            return candidate
    return None


class _HeaderGetter(Getter[Mapping[str, str]]):
    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = header(carrier, key)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


_getter = _HeaderGetter()


def inject(
    headers: MutableMapping[str, str] | None = None, *, context: Context | None = None
) -> MutableMapping[str, str]:
    """Add the trace context of ``context`` (default: the current one) to ``headers`` and return them.

    With no active span nothing is added, so this is safe to call always.
    """
    carrier: MutableMapping[str, str] = {} if headers is None else headers
    _propagator.inject(carrier, context=context)
    return carrier


def extract(headers: Mapping[str, str] | None, *, context: Context | None = None) -> Context:
    """The OpenTelemetry context carried by ``headers`` (on top of ``context``); empty if none."""
    return _propagator.extract(headers or {}, context=context, getter=_getter)


def traceparent(headers: Mapping[str, str] | None = None) -> str | None:
    """The ``traceparent`` in ``headers``, or of the current span when ``headers`` is None.

    Handy for the ``trace`` field of a :class:`schemas.Envelope`.
    """
    if headers is None:
        headers = dict(inject({}))
    return header(headers, TRACEPARENT)
