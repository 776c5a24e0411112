"""Prometheus view of a bus connection: what the NATS server refused, and disconnects.

:class:`BusCollector` reads the counters a :class:`bus.jetstream.JetStreamBus`
keeps (``permission_violations`` by operation, ``num_disconnects``) at scrape
time; each component registers it in its own registry next to its metrics.
A permission violation means this process tried a subject its NATS user may
not use: the server dropped the message (a JetStream API call then times
out), so a non-zero count is a misconfiguration or an intrusion to look at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["BusCollector", "CountsViolations"]


class CountsViolations(Protocol):
    @property
    def permission_violations(self) -> Mapping[str, int]: ...

    @property
    def num_disconnects(self) -> int: ...


class BusCollector(Collector):
    """``shoal_nats_permission_violations_total{operation}`` and ``shoal_nats_disconnects_total``."""

    def __init__(self, bus: Callable[[], CountsViolations | None]) -> None:
        self._bus = bus

    def collect(self) -> Iterator[CounterMetricFamily]:
        bus = self._bus()
        violations = CounterMetricFamily(
            "shoal_nats_permission_violations",
            "Operations the NATS server refused for this process's user, by operation",
            labels=["operation"],
        )
        counts = dict(bus.permission_violations) if bus is not None else {}
        for operation in ("publish", "subscribe"):
            violations.add_metric([operation], float(counts.get(operation, 0)))
        yield violations
        yield CounterMetricFamily(
            "shoal_nats_disconnects",
            "Times the NATS connection was lost",
            value=float(bus.num_disconnects) if bus is not None else 0.0,
        )
