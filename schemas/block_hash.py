"""The prefix-cache identity of KV blocks: one chained hash per full block of tokens.

A block's hash covers its parent's hash and its own token ids, so a hash names the whole
prefix up to the end of that block: two requests share a block's KV exactly when they share
its hash. Every party computes it with this one function: the engines (to find cached
blocks), the agents (in the cache events they publish), the frontend (the chain a dispatch
request carries) and the scheduler's prefix index (which looks the chain up).

The chain starts from a root that covers the block size and an optional salt (a tenant's
``cache_salt``: requests with different salts never share blocks). The model, its dtype and
its KV layout are not in the hash: an engine's cache holds one model's KV, the scheduler
keeps one index per instance and places a request only on instances of its model, and a
migration is refused between instances whose model identity or KV layout differ
(``EngineInfo.can_migrate_to``).

Hashes are BLAKE2b digests cut to 63 bits, so they are non-negative 64-bit integers on every
wire (msgpack, JSON) and a collision needs about 2**63 tries for a chosen prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["HASH_MASK", "block_hashes", "extend_block_hashes", "root_hash"]

#: Hashes are cut to 63 bits: non-negative in a signed 64-bit integer.
HASH_MASK = (1 << 63) - 1
_VERSION = b"shoal-prefix-v1"


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & HASH_MASK


def root_hash(block_size: int, salt: str = "") -> int:
    """The parent hash of a chain's first block, for ``block_size`` tokens per block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _digest(_VERSION + block_size.to_bytes(4, "little") + salt.encode())


def _block_hash(parent: int, tokens: Sequence[int]) -> int:
    return _digest(parent.to_bytes(8, "little") + array("q", tokens).tobytes())


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, root: int) -> list[int]:
    """Append to ``hashes`` (the chain of ``token_ids``' first ``len(hashes)`` blocks) the hashes
    of the further full blocks of ``token_ids``; returns ``hashes``. A partial last block has none."""
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = _block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The chain of ``token_ids``: one hash per full block, in order."""
    return extend_block_hashes([], token_ids, block_size, root_hash(block_size, salt))
