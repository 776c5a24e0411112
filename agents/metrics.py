"""Prometheus metrics of one agent, on a registry of its own (served by ``shoal agent --metrics-port``).

Read at scrape time from the latest :class:`~agents.engines.protocol.EngineStats`
the agent took (each load-report round takes one):
KV blocks (total, free, used, reserved for incoming migrations), running and
waiting requests, cumulative preemptions, and the prefix cache as vLLM counts it
(``shoal_prefix_cache_queries_total`` and ``_hits_total`` in tokens, so hits over
queries is the token hit rate; ``_evictions_total`` and the ``shoal_prefix_cache_blocks``
gauge in blocks). Observed as they happen: engine
step duration and batch size (per step, from the agent's step listeners),
how late the event loop wakes (the agent's load-report loop measures it),
and, per migration this agent started as the source, its outcome, the
:class:`~schemas.reasons.MigrationAbortReason` of one that did not happen
(label values are the enum's values), its downtime (suspend to resume), each
copy stage's duration and the KV bytes it moved. Names follow Prometheus and
vLLM conventions: ``shoal_agent_`` prefix, ``_seconds``, ``_bytes``, ``_total``.
Nothing here serves HTTP; the entry point does (:mod:`agents.cli`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agents.engines.protocol import EngineStats, StepResult
from agents.migration.source import MigrationOutcome
from bus.heap import register_heap_metrics
from schemas.reasons import MigrationAbortReason

__all__ = ["AgentMetrics"]

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        used = stats.num_total_blocks - stats.num_free_blocks
        yield GaugeMetricFamily("shoal_agent_kv_blocks", "KV cache blocks of the engine",
                                value=stats.num_total_blocks)
        yield GaugeMetricFamily("shoal_agent_kv_blocks_free", "KV cache blocks free",
                                value=stats.num_free_blocks)
        yield GaugeMetricFamily("shoal_agent_kv_blocks_used", "KV cache blocks in use (reserved included)",
                                value=used)
        yield GaugeMetricFamily("shoal_agent_kv_blocks_reserved",
                                "KV cache blocks reserved for incoming migrations",
                                value=stats.num_reserved_blocks)
        yield GaugeMetricFamily("shoal_agent_num_requests_running", "Requests in the running batch",
                                value=stats.num_running)
        yield GaugeMetricFamily("shoal_agent_num_requests_waiting", "Requests waiting (preempted included)",
                                value=stats.num_waiting)
        yield CounterMetricFamily("shoal_agent_preemptions",
                                  "Preemptions by recompute since the engine started",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("shoal_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache at admission",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("shoal_prefix_cache_hits",
                                  "Of the tokens looked up, those found cached (not computed)",
                                  value=stats.prefix_cache_hits)
        yield CounterMetricFamily("shoal_prefix_cache_evictions",
                                  "Cached KV blocks evicted to make room", value=stats.prefix_cache_evictions)
        yield GaugeMetricFamily("shoal_prefix_cache_blocks",
                                "KV blocks in the prefix cache (in use or evictable)",
                                value=stats.num_cached_blocks)


class AgentMetrics:
    """One agent's metrics; wire :meth:`observe_step` and :meth:`observe_migration` to its events."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None]) -> None:
        """``engine_stats``: the latest snapshot the agent took (scrapes run on another thread, so
        they read a snapshot the event loop made rather than the engine itself); None before one."""
        self.registry = CollectorRegistry(auto_describe=True)
        register_heap_metrics(self.registry)  # garbage collection (bus/heap.py)
        r = self.registry
        self.step_duration = Histogram(
            "shoal_agent_step_duration_seconds", "Engine step time (modeled for sim, measured for torch)",
            buckets=_STEP_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "shoal_agent_batch_size", "Requests scheduled per engine step",
            buckets=_BATCH_BUCKETS, registry=r,
        )
        self.loop_lag = Histogram(
            "shoal_agent_loop_lag_seconds",
            "How late the agent's event loop woke from a timed sleep (bus messages wait as long)",
            buckets=_LAG_BUCKETS, registry=r,
        )
        self.migrations = Counter(
            "shoal_agent_migrations", "Migrations this agent started as the source, by outcome",
            ["outcome"], registry=r,
        )
        self.migration_aborts = Counter(
            "shoal_agent_migration_aborts", "Migrations that did not happen, by MigrationAbortReason",
            ["reason"], registry=r,
        )
        self.migration_downtime = Histogram(
            "shoal_agent_migration_downtime_seconds", "Suspend on the source to resume on the destination",
            buckets=_DOWNTIME_BUCKETS, registry=r,
        )
        self.migration_stage_duration = Histogram(
            "shoal_agent_migration_stage_duration_seconds", "One KV copy stage of a migration",
            buckets=_STAGE_BUCKETS, registry=r,
        )
        self.migration_bytes = Counter(
            "shoal_agent_migration_bytes", "KV bytes sent by migration copy stages", registry=r
        )
        self.migrations_hurried = Counter(
            "shoal_agent_migrations_hurried",
            "Paced migrations (--migration-copy-share) this agent sourced that went on at full speed, by why",
            ["reason"], registry=r,
        )
        for outcome in ("migrated", "aborted"):
            self.migrations.labels(outcome=outcome)
        for why in ("short_of_memory", "slot_wanted"):
            self.migrations_hurried.labels(reason=why)
        for reason in MigrationAbortReason:
            self.migration_aborts.labels(reason=reason.value)
        r.register(_EngineCollector(engine_stats))

    def observe_step(self, result: StepResult) -> None:
        if result.num_scheduled == 0:
            return
        self.step_duration.observe(result.duration_s)
        self.batch_size.observe(result.num_scheduled)

    def observe_migration(self, outcome: MigrationOutcome) -> None:
        for stage in outcome.stages:
            self.migration_stage_duration.observe(stage.duration_s)
            self.migration_bytes.inc(stage.num_bytes)
        if outcome.hurried is not None:
            self.migrations_hurried.labels(reason=outcome.hurried).inc()
        if outcome.migrated:
            self.migrations.labels(outcome="migrated").inc()
            downtime = outcome.downtime_s
            if downtime is not None:
                self.migration_downtime.observe(max(0.0, downtime))
            return
        self.migrations.labels(outcome="aborted").inc()
        if outcome.reason is not None:
            self.migration_aborts.labels(reason=outcome.reason.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
