"""Test helpers: serve a Prometheus registry over real HTTP and scrape an endpoint into samples."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

__all__ = ["Samples", "scrape", "serving", "value"]

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
