"""Prefix-cache events: what each instance's KV cache gained and lost, as block hashes.

An agent publishes one :class:`KVCacheEvents` batch per engine step in which its prefix cache
changed, on its own subject (``Subjects.kv``, stored in the ``<prefix>_kv`` JetStream stream),
numbered ``seq`` 1, 2, 3, ... per agent process (``incarnation``), so the scheduler's prefix
index notices a lost batch. A batch with ``full`` set replaces everything the index held for the
instance: ``stored`` is then the whole cache. An agent's first batch is full (possibly empty);
it publishes another full batch when asked with a :class:`KVCacheSync` over ``Subjects.kv_sync``
(the scheduler asks after a gap or on an unknown incarnation) and every few minutes on its own,
so a replay of the bounded stream finds a starting point for every instance.

Hashes are the chained block hashes of :mod:`schemas.block_hash` (non-negative 64-bit integers),
for blocks of ``block_size`` tokens: msgpack carries each in at most 9 bytes.
"""

from __future__ import annotations

import enum

from schemas.base import Message

__all__ = ["KVCacheEvents", "KVCacheSync", "KVCacheSyncAck", "KVMessage", "KVSyncReason"]


class KVSyncReason(enum.StrEnum):
    """Why the scheduler asks an agent for a full batch (``KVCacheSync.reason``)."""

    #: a batch's ``seq`` skipped one or more numbers: a batch was lost
    GAP = "gap"
    #: a batch of an incarnation the index never saw start (its full batch was lost or dropped)
    UNKNOWN_INCARNATION = "unknown_incarnation"
    #: asked by an operator or a test
    REQUESTED = "requested"


class KVCacheEvents(Message, frozen=True, kw_only=True, tag="kv_cache_events", omit_defaults=True):
    """One batch (empty ``stored`` / ``removed`` and a false ``full`` are left out on the wire)."""

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
    reason: KVSyncReason = KVSyncReason.REQUESTED


class KVCacheSyncAck(Message, frozen=True, kw_only=True, tag="kv_cache_sync_ack"):
    """Agent → scheduler: the full batch will go out as ``seq`` of ``incarnation``."""

    instance_id: str
    incarnation: str
    seq: int


KVMessage = KVCacheEvents | KVCacheSync | KVCacheSyncAck
