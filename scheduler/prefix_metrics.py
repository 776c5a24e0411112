"""Prometheus gauges and counters of the scheduler's prefix index, read at scrape time.

:class:`PrefixIndexCollector` reports what :class:`~scheduler.prefix_index.PrefixIndex` holds
and has seen, from a :class:`PrefixIndexReading` the service takes on its own thread at every
tick (a scrape runs on another thread and never walks the index itself):

* ``shoal_scheduler_prefix_index_instances``, ``_blocks`` (distinct hashes), ``_entries``
  ((instance, block) pairs), ``_stale_instances`` (waiting for a full batch);
* ``shoal_scheduler_prefix_index_batches_total``, ``_gaps_total`` (lost batches noticed),
  ``_unknown_incarnations_total``, ``_malformed_total``, ``_resyncs_total`` (full batches asked).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.prefix_index import PrefixIndex

__all__ = ["PrefixIndexCollector", "PrefixIndexReading", "read_index"]


class PrefixIndexReading(msgspec.Struct, frozen=True):
    instances: int = 0
    blocks: int = 0
    entries: int = 0
    stale_instances: int = 0
    batches: int = 0
    gaps: int = 0
    unknown_incarnations: int = 0
    malformed: int = 0
    resyncs: int = 0


def read_index(index: PrefixIndex, resyncs: int) -> PrefixIndexReading:
    """The index's figures now (call it on the thread that changes the index)."""
    return PrefixIndexReading(
        instances=len(index),
        blocks=index.num_hashes,
        entries=index.num_entries,
        stale_instances=len(index.stale_instances()),
        batches=index.num_batches,
        gaps=index.num_gaps,
        unknown_incarnations=index.num_unknown_incarnations,
        malformed=index.num_malformed,
        resyncs=resyncs,
    )


_GAUGES = {
    "instances": "Instances the prefix index holds cached blocks of",
    "blocks": "Distinct cached blocks (hashes) in the prefix index",
    "entries": "(instance, cached block) pairs in the prefix index",
    "stale_instances": "Instances the prefix index is unsure of until their full cache batch",
}
_COUNTERS = {
    "batches": "Cache batches folded into the prefix index",
    "gaps": "Cache batches found missing (a skipped seq)",
    "unknown_incarnations": "Cache batches of an agent process the index never saw start",
    "malformed": "kv-stream entries rejected as malformed",
    "resyncs": "Full cache batches asked of agents (KVCacheSync)",
}


class PrefixIndexCollector(Collector):
    def __init__(self, reading: Callable[[], PrefixIndexReading]) -> None:
        self._reading = reading

    def collect(self) -> Iterable[Metric]:
        now = self._reading()
        for name, text in _GAUGES.items():
            yield GaugeMetricFamily(f"shoal_scheduler_prefix_index_{name}", text, value=getattr(now, name))
        for name, text in _COUNTERS.items():
            yield CounterMetricFamily(f"shoal_scheduler_prefix_index_{name}", text, value=getattr(now, name))
