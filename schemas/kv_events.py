"""Prefix-cache events: what each instance's KV cache gained and lost, as block hashes.

An agent publishes one :class:`KVCacheEvents` batch per engine step in which its prefix cache
changed, on its own subject (``Subjects.kv``), numbered ``seq`` 1, 2, 3, ... per agent
process (``incarnation``), so the scheduler's prefix index notices a lost batch. A batch with
``full`` set replaces everything the index held for the instance: ``stored`` is then the whole
cache. An agent's first batch is full (possibly empty); it publishes another full batch when
asked over ``Subjects.kv_sync`` (the scheduler asks after a gap or on an unknown incarnation).

Hashes are the chained block hashes of :mod:`schemas.block_hash` (non-negative 64-bit integers),
for blocks of ``block_size`` tokens: msgpack carries each in at most 9 bytes.
"""

from __future__ import annotations

from schemas.base import Message

__all__ = ["KVCacheEvents", "KVCacheSync"]


class KVCacheEvents(Message, frozen=True, kw_only=True, tag="kv_cache_events"):
    instance_id: str
    incarnation: str
    seq: int
    block_size: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    full: bool = False


class KVCacheSync(Message, frozen=True, kw_only=True, tag="kv_cache_sync"):
    """Scheduler → agent: publish a full batch (``KVCacheEvents.full``) of your cache now."""

    instance_id: str
    reason: str = ""
