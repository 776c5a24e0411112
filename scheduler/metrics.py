"""Prometheus metrics of one scheduler process, on a registry of its own (``shoal scheduler --metrics-port``).

Dispatch decision latency (the RPC handler's start to its encoded reply),
decisions by kind (each event the scheduler appends: ``dispatched``,
``paired``, ``unpaired``, ``scale_up``, ``scale_down``, ``instance_failed``,
``tick``), dispatches refused by :class:`~schemas.reasons.DispatchFailReason`,
event-log append latency (handing a decision to the pipelined appender until
the log acknowledged it), the event-log read lag by stream (a message stored
until the scheduler read it, once it caught up), and, read at scrape time, the lease epoch and the
role (``shoal_scheduler_role{role=...}`` is 1 for the current one: active,
standby, ...). Names follow Prometheus and vLLM conventions (``shoal_``
prefix, ``_seconds``, ``_total``). Nothing here serves HTTP; the entry point
does (:mod:`scheduler.cli`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bus.heap import register_heap_metrics
from scheduler.service_config import Role
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, SchedulerTick, Unpaired
from schemas.envelope import Body
from schemas.instance import InstanceFailed
from schemas.reasons import DispatchFailReason

__all__ = ["SchedulerMetrics", "decision_kind"]

_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_APPEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_KINDS: dict[type, str] = {
    Dispatched: "dispatched",
    Paired: "paired",
    Unpaired: "unpaired",
    ScaleUp: "scale_up",
    ScaleDown: "scale_down",
    InstanceFailed: "instance_failed",
    SchedulerTick: "tick",
}


def decision_kind(body: Body) -> str:
    """The ``kind`` label of an event the scheduler appends (a queued request moved off a stalled
    instance is ``requeued``)."""
    if isinstance(body, Dispatched) and body.requeued_from:
        return "requeued"
    return _KINDS.get(type(body), "other")


class _LeaseCollector(Collector):
    def __init__(self, lease: Callable[[], tuple[Role, int]]) -> None:
        self._lease = lease

    def collect(self) -> Iterable[GaugeMetricFamily]:
        role, epoch = self._lease()
        yield GaugeMetricFamily("shoal_scheduler_lease_epoch", "Epoch of the lease this scheduler last held",
                                value=epoch)
        roles = GaugeMetricFamily("shoal_scheduler_role", "1 for this scheduler's current role",
                                  labels=["role"])
        for candidate in Role:
            roles.add_metric([candidate.value], 1.0 if candidate is role else 0.0)
        yield roles


class SchedulerMetrics:
    """One scheduler's metrics. ``lease`` gives (role, epoch) at scrape time (read from another thread)."""

    def __init__(self, lease: Callable[[], tuple[Role, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        register_heap_metrics(self.registry)  # garbage collection (bus/heap.py)
        r = self.registry
        self.decision_latency = Histogram(
            "shoal_scheduler_dispatch_decision_seconds", "Dispatch RPC handling: request in to reply out",
            buckets=_DECISION_BUCKETS, registry=r,
        )
        self.decisions = Counter(
            "shoal_scheduler_decisions", "Events the scheduler appended, by kind", ["kind"], registry=r
        )
        self.dispatch_failures = Counter(
            "shoal_scheduler_dispatch_failures", "Dispatch requests refused, by DispatchFailReason",
            ["reason"], registry=r,
        )
        self.append_latency = Histogram(
            "shoal_scheduler_event_log_append_seconds",
            "A decision handed to the appender until the scheduler read it back from the log",
            buckets=_APPEND_BUCKETS, registry=r,
        )
        self.read_lag = Histogram(
            "shoal_scheduler_event_log_read_lag_seconds",
            "A message stored in the log until the scheduler read it (after catching up), by stream",
            ["stream"], buckets=_APPEND_BUCKETS, registry=r,
        )
        self.failure_probes = Counter(
            "shoal_scheduler_failure_probes",
            "Silent instances asked directly before being marked failed, by answer (alive: still sending "
            "reports; not_reporting, no_responders, timeout: failed; error: the scheduler's bus)",
            ["result"], registry=r,
        )
        for result in ("alive", "not_reporting", "no_responders", "timeout", "error"):
            self.failure_probes.labels(result=result)
        # labelled children looked up once: ``labels()`` per message costs more than the observation
        self._decisions_by_kind = {
            kind: self.decisions.labels(kind=kind) for kind in sorted(set(_KINDS.values()))
        }
        self._read_lag_by_stream: dict[str, Histogram] = {}
        for reason in DispatchFailReason:
            self.dispatch_failures.labels(reason=reason.value)
        r.register(_LeaseCollector(lease))

    def observe_read(self, stream: str, stored_at: float, now: float) -> None:
        child = self._read_lag_by_stream.get(stream)
        if child is None:
            child = self._read_lag_by_stream[stream] = self.read_lag.labels(stream=stream)
        child.observe(max(0.0, now - stored_at))

    def observe_decision(self, body: Body) -> None:
        kind = decision_kind(body)
        child = self._decisions_by_kind.get(kind)
        if child is None:
            child = self._decisions_by_kind[kind] = self.decisions.labels(kind=kind)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
