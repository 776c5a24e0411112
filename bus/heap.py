"""A long-running component's startup heap, kept out of the garbage collector's full passes.

A started torch agent holds hundreds of thousands of Python objects (its imports, the engine,
the model's modules) before it serves anything. CPython's cyclic collector walks all of them in
every full (generation 2) collection, a pause longer than a decode step during which the agent's
event loop, its step loop and its migration handshakes stand still (a decode step late by that
much is a TPOT spike a client sees; docs/operating.md shows how to read the pauses). A full
collection comes whenever the objects that survived since the last one reach a quarter of the
long-lived ones, so a busy process meets one every so often, at a moment nobody chooses.

:func:`freeze_startup_heap` collects once, then moves every object alive at that point into
the permanent generation (:func:`gc.freeze`), which later collections skip: they walk only
what the process allocated since. vLLM freezes its engine core's heap after start-up for the
same reason. The frozen objects live for the whole process, as start-up objects do anyway.
:func:`register_heap_metrics`, which every component's metrics registry calls, shows the effect on
``/metrics``: how many objects are frozen, and how long every collection stopped the process
(``shoal_gc_pause_seconds{generation}``), so a latency spike can be checked against the collector.

Called by ``shoal agent``, ``shoal serve`` and the torch engine's core process once they are
ready (not by library code: a test process that starts components in turn would pin every
earlier test's objects). The scheduler
freezes what its recovery built (``scheduler/service.py``).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector

__all__ = ["freeze_startup_heap", "register_heap_metrics"]

log = logging.getLogger(__name__)

#: One per process (a collection stops the whole process), on every registry that asks for it.
_PAUSES = Histogram(
    "shoal_gc_pause_seconds",
    "How long each garbage collection stopped the process, by generation",
    ["generation"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=None,
)
_BY_GENERATION = [_PAUSES.labels(generation=str(generation)) for generation in range(3)]
_started = 0.0


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
    else:
        _BY_GENERATION[info["generation"]].observe(time.perf_counter() - _started)


def freeze_startup_heap() -> int:
    """Collect, then freeze every live object out of later collections; how many are frozen."""
    started = time.perf_counter()
    gc.collect()
    took_ms = (time.perf_counter() - started) * 1000
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of later collections (a full collection of them "
             "took %.0f ms)", frozen, took_ms)
    return frozen


def register_heap_metrics(registry: CollectorRegistry) -> None:
    """``shoal_gc_frozen_objects``, ``shoal_gc_pause_seconds{generation}`` and the Python
    collector's counts per generation (``python_gc_collections_total``, ...) on ``registry``."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    registry.register(_PAUSES)
    Gauge(
        "shoal_gc_frozen_objects",
        "Objects moved out of the garbage collector's passes at start-up (gc.freeze)",
        registry=registry,
    ).set_function(gc.get_freeze_count)
    GCCollector(registry=registry)
