"""Prometheus metrics of the frontend, on a registry of their own (one per app).

Requests by endpoint and outcome, TTFT, time per output token and end-to-end
latency histograms, tokens in and out (and the prompt tokens instances found in their
prefix caches), migrations seen in streams (an owner
change the frontend did not cause), recomputes (a request restarted from its
prompt plus generated tokens, which is what a rescue is), per-instance
freeness, running and waiting counts and cumulative preemptions from the load
board (the agents' load reports carry them), instances by readiness
(``shoal_instances{state="ready"}``: what ``/health`` answers from), bypass placements, rescues by
cause, gap repairs, overload refusals, agents' refusals of a request by reason
and requests closed unfinished by reason (label values are the
:mod:`schemas.reasons` enum values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bus.heap import register_heap_metrics
from frontend.board import Readiness
from scheduler.policy import InstanceLoad

__all__ = ["CONTENT_TYPE", "FrontendMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _FreenessCollector(Collector):
    def __init__(self, loads: Callable[[], Iterable[InstanceLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        freeness = GaugeMetricFamily(
            "shoal_instance_freeness", "Freeness last reported by each live instance", labels=["instance"]
        )
        running = GaugeMetricFamily(
            "shoal_instance_running", "Running requests last reported by each instance", labels=["instance"]
        )
        waiting = GaugeMetricFamily(
            "shoal_instance_waiting", "Waiting requests last reported by each instance", labels=["instance"]
        )
        preemptions = CounterMetricFamily(
            "shoal_instance_preemptions",
            "Preemptions by recompute each instance reported since its engine started",
            labels=["instance"],
        )
        for load in self._loads():
            freeness.add_metric([load.instance_id], load.reported_freeness)
            running.add_metric([load.instance_id], load.num_running)
            waiting.add_metric([load.instance_id], load.num_waiting)
            preemptions.add_metric([load.instance_id], load.num_preemptions)
        yield freeness
        yield running
        yield waiting
        yield preemptions


class _ReadinessCollector(Collector):
    def __init__(self, readiness: Callable[[], Mapping[str, Readiness]]) -> None:
        self._readiness = readiness

    def collect(self) -> Iterable[GaugeMetricFamily]:
        states = list(self._readiness().values())
        family = GaugeMetricFamily(
            "shoal_instances", "Instances known to this frontend, by readiness (ready: placed on)",
            labels=["state"],
        )
        for state in Readiness:
            family.add_metric([state.value], states.count(state))
        yield family


class FrontendMetrics:
    """The frontend's counters and histograms; :meth:`render` gives the exposition text."""

    def __init__(
        self,
        loads: Callable[[], Iterable[InstanceLoad]] = tuple,
        readiness: Callable[[], Mapping[str, Readiness]] = dict,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        register_heap_metrics(self.registry)  # garbage collection (bus/heap.py)
        r = self.registry
        self.requests = Counter(
            "shoal_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.in_flight = Gauge("shoal_requests_in_flight", "Requests being served now", registry=r)
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds", "Arrival to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "shoal_time_per_output_token_seconds", "Mean time between output tokens per request",
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "shoal_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("shoal_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.output_tokens = Counter("shoal_generation_tokens", "Tokens generated for clients", registry=r)
        self.cached_prompt_tokens = Counter(
            "shoal_prompt_cached_tokens",
            "Prompt tokens of finished requests that their instance found in its prefix cache", registry=r,
        )
        self.migrations = Counter(
            "shoal_migrations_observed", "Owner changes seen in token streams (live migrations)", registry=r
        )
        self.recomputes = Counter(
            "shoal_recomputes", "Requests restarted from prompt + generated tokens elsewhere", registry=r
        )
        self.bypass = Counter(
            "shoal_bypass_placements", "Requests placed by the frontend without the scheduler", registry=r
        )
        self.scheduler_placements = Counter(
            "shoal_scheduler_placements", "Requests placed where the scheduler said", registry=r
        )
        self.rescues = Counter(
            "shoal_rescues", "Requests rescued from a failed or stalled instance", ["cause"], registry=r
        )
        self.generate_timeouts = Counter(
            "shoal_generate_timeouts", "Generate calls an agent did not answer in time (each is asked again)",
            registry=r,
        )
        self.resends = Counter("shoal_resend_requests", "Gap repairs asked of agents", registry=r)
        self.stale_deltas = Counter("shoal_stale_deltas", "Deltas dropped as stale or duplicate", registry=r)
        self.rejected = Counter("shoal_rejected", "Requests refused for overload", ["status"], registry=r)
        self.refusals = Counter(
            "shoal_generate_refusals", "Agents' refusals of a request, by RejectReason", ["reason"],
            registry=r,
        )
        self.aborted = Counter(
            "shoal_requests_aborted", "Requests closed before they finished, by CloseReason", ["reason"],
            registry=r,
        )
        r.register(_FreenessCollector(loads))
        r.register(_ReadinessCollector(readiness))

    def render(self) -> bytes:
        return generate_latest(self.registry)
