"""Test helpers: serve a Prometheus registry over real HTTP and scrape an endpoint into samples."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

__all__ = ["Samples", "metric_names", "scrape", "serving", "value"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@contextlib.contextmanager
def serving(registry: CollectorRegistry) -> Iterator[str]:
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def scrape(url: str) -> Samples:
    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    text = await asyncio.to_thread(fetch)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def metric_names(url: str) -> set[str]:
    """Every series name ``url`` can expose: its samples', and for each family the names its type implies.

    A labelled counter or histogram shows no sample until its first observation,
    but Prometheus will have the series once it happens, so a query of it is valid.
    """

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    text = await asyncio.to_thread(fetch)
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",)}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
