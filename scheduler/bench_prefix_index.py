"""``python -m scheduler.bench_prefix_index``: the prefix index's memory, lookup and snapshot cost.

Builds a :class:`~scheduler.prefix_index.PrefixIndex` of ``--instances`` instances holding
``--blocks`` cached blocks each (full batches, as after a re-sync), measures the memory it holds
with ``tracemalloc`` (bytes per (instance, block) entry), and extrapolates to 1,000 instances x
10,000 blocks. ``--shared`` is the fraction of each instance's blocks that every instance holds
(a common system prompt: one hash, many holders); the rest are the instance's own. It also
times a chain lookup (``overlap`` of a 64-block chain whose start the shared blocks are, the
32 best kept as the scheduler does)
and one snapshot encoding.
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from typing import Any

import click

from scheduler.prefix_index import PrefixIndex, encode_index
from schemas.kv_events import KVCacheEvents

__all__ = ["main", "measure"]


def measure(num_instances: int, num_blocks: int, shared: float, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    num_shared = int(num_blocks * shared)
    common = [rng.getrandbits(63) for _ in range(num_shared)]
    batches = [
        KVCacheEvents(
            instance_id=f"instance-{n:04d}", incarnation=f"{n:012x}", seq=1, block_size=16, full=True,
            stored=(*common, *(rng.getrandbits(63) for _ in range(num_blocks - num_shared))),
        )
        for n in range(num_instances)
    ]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for batch in batches:
        index.apply(batch)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = index.num_entries
    chain = (*common[:32], *(rng.getrandbits(63) for _ in range(32)))
    started = time.perf_counter()
    rounds = 200
    for _ in range(rounds):
        index.overlap(chain, block_size=16, limit=32)
    lookup_us = (time.perf_counter() - started) / rounds * 1e6
    started = time.perf_counter()
    snapshot = encode_index(index)
    encode_s = time.perf_counter() - started
    per_entry = held / entries
    return {
        "instances": num_instances, "blocks": num_blocks, "shared": shared, "entries": entries,
        "distinct_hashes": index.num_hashes, "bytes": held, "bytes_per_entry": round(per_entry, 1),
        "gb_at_1000x10k": round(per_entry * 1000 * 10_000 / 1e9, 2),
        "lookup_64_blocks_us": round(lookup_us, 1), "snapshot_bytes": len(snapshot),
        "snapshot_encode_s": round(encode_s, 3),
    }


@click.command()
@click.option("--instances", default=1000, show_default=True)
@click.option("--blocks", default=1000, show_default=True, help="Cached blocks per instance.")
@click.option("--shared", default=0.0, show_default=True, help="Fraction of blocks every instance holds.")
def main(instances: int, blocks: int, shared: float) -> None:
    click.echo(json.dumps(measure(instances, blocks, shared)))


if __name__ == "__main__":
    main()
