"""Measuring the KV data plane: bandwidth of a transport kind for given buffer sizes.

``measure_bandwidth`` starts a sender and a receiver of one kind in this
process and event loop, moves each size ``repeats`` times the way a migration
stage does (``expect`` into a preallocated buffer, ``send``, await the
landing), and reports the median and best GB/s (10^9 bytes per second) over
the timed repeats; one untimed warm-up transfer per size opens the
connection. Both ends share this process's CPU, so on a small machine a
cross-process or cross-host run is faster than these numbers.

The migration benchmark calls it; ``python -m transport.bench`` prints a table
(the only entry point here).
"""

from __future__ import annotations

import statistics
import time

import msgspec

from bus import event_loop
from transport.base import TransferHeader
from transport.config import TransportConfig
from transport.factory import create_transport
from transport.protocol import KVTransport

__all__ = ["BandwidthResult", "format_results", "measure_bandwidth"]

MiB = 1 << 20


class BandwidthResult(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    nbytes: int
    repeats: int
    median_gbps: float
    best_gbps: float
    median_latency_s: float


async def measure_bandwidth(
    config: TransportConfig,
    sizes: tuple[int, ...] = (MiB, 16 * MiB, 128 * MiB),
    *,
    repeats: int = 5,
    total_budget_bytes: int = 1 << 30,
) -> list[BandwidthResult]:
    """GB/s of ``config``'s transport for each size; sizes repeat fewer times when
    ``repeats * size`` would exceed ``total_budget_bytes`` (at least 2 timed repeats)."""
    sender = create_transport(config)
    receiver = create_transport(config)
    await sender.start()
    try:
        address = await receiver.start()
        try:
            return [
                await _measure_size(sender, receiver, address, size, repeats, total_budget_bytes)
                for size in sizes
            ]
        finally:
            await receiver.close()
    finally:
        await sender.close()


async def _measure_size(
    sender: KVTransport, receiver: KVTransport, address: str, size: int, repeats: int, budget: int
) -> BandwidthResult:
    count = max(2, min(repeats, budget // max(size, 1)))
    payload = bytearray(size)
    payload[::4096] = b"\x5a" * len(range(0, size, 4096))
    into = bytearray(size)
    migration_id = f"bench-{size}"
    durations: list[float] = []
    for stage in range(count + 1):
        pending = receiver.expect(migration_id, stage, size, into=into)
        started = time.perf_counter()
        header = TransferHeader(migration_id=migration_id, stage=stage, nbytes=size)
        await sender.send(address, header, payload)
        await pending
        if stage > 0:
            durations.append(time.perf_counter() - started)
    if into != payload:
        raise AssertionError(f"{sender.kind} delivered corrupted bytes at size {size}")
    median = statistics.median(durations)
    return BandwidthResult(
        kind=sender.kind,
        nbytes=size,
        repeats=count,
        median_gbps=size / median / 1e9,
        best_gbps=size / min(durations) / 1e9,
        median_latency_s=median,
    )


def format_results(results: list[BandwidthResult]) -> str:
    lines = [
        f"{'kind':<7} {'size':>9} {'repeats':>7} {'median GB/s':>12} {'best GB/s':>10} {'median ms':>10}"
    ]
    for result in sorted(results, key=lambda r: (r.kind, r.nbytes)):
        lines.append(
            f"{result.kind:<7} {_size(result.nbytes):>9} {result.repeats:>7} "
            f"{result.median_gbps:>12.3f} {result.best_gbps:>10.3f} {result.median_latency_s * 1e3:>10.2f}"
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes} B"


async def _main() -> None:
    from transport.ucx import ucx_available

    results: list[BandwidthResult] = []
    configs = [TransportConfig(kind="tcp"), TransportConfig(kind="inproc")]
    if ucx_available() is None:
        configs.insert(1, TransportConfig(kind="ucx", ucx_tls="tcp"))
    for config in configs:
        results.extend(await measure_bandwidth(config))
    print(format_results(results))


if __name__ == "__main__":
    event_loop.run(_main())
