"""Prefix-cache hit rates of the Mooncake synthetic trace under simple cache models, no simulation.

Each request's hit is its longest run of leading hash ids found in the cache of the instance it
goes to (at most all but its last token, at 16 tokens a block), over all prompt tokens; requests
longer than 131,072 tokens (the 8B H100 profile's context) are left out. Instances take requests
round-robin in arrival order. ``infinite``: every block stays cached; ``lru``: each instance keeps
the 812 most recently used 512-token blocks (26,000 blocks of 16 tokens, the 8B H100 profile).

    python docs/sim/prefix-cache/bounds.py
"""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from pathlib import Path

TRACE = Path(__file__).resolve().parents[3] / "scheduler/sim/traces/mooncake_synthetic.jsonl.gz"
CONTEXT = 131_072
LRU_BLOCKS = 26_000 * 16 // 512


def hit_rate(rows: list[dict[str, object]], num_instances: int, capacity: int | None) -> float:
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_instances)]
    hit = total = 0
    for index, row in enumerate(rows):
        cache = caches[index % num_instances]
        hash_ids = row["hash_ids"]
        length = row["input_length"]
        assert isinstance(hash_ids, list) and isinstance(length, int)
        shared = 0
        while shared < len(hash_ids) and hash_ids[shared] in cache:
            shared += 1
        hit += min(shared * 512, (length - 1) // 16 * 16)
        total += length
        for block in hash_ids:
            cache[block] = None
            cache.move_to_end(block)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total


def main() -> None:
    with gzip.open(TRACE, "rt") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows = [r for r in rows if r["input_length"] + r["output_length"] <= CONTEXT]
    for instances in (1, 16):
        print(f"{instances:2d} instances, infinite caches: {hit_rate(rows, instances, None):.1%}")
    print(f"16 instances, LRU of {LRU_BLOCKS} blocks: {hit_rate(rows, 16, LRU_BLOCKS):.1%}")


if __name__ == "__main__":
    main()
