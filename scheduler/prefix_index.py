"""The scheduler's prefix index: which instance holds which cached KV blocks, by block hash.

:class:`PrefixIndex` folds the agents' :class:`~schemas.kv_events.KVCacheEvents` batches (the
``<prefix>_kv`` stream, in stream order) into

* per instance: its agent's incarnation, the last batch ``seq`` applied, its block size, the set
  of hashes it caches, and whether the index is unsure of it (``stale``);
* per hash: a bit mask of the instances holding it (one bit per instance slot).

:meth:`PrefixIndex.overlap` walks a request's chain once, narrowing the mask of holders block by
block, and returns per instance how many leading blocks of the chain it holds: the cost is one
dict lookup and one integer AND per block, whatever the number of instances.

Batches are checked like the event fold checks positions: a stream sequence not after the last
one applied is a repeat (no-op); a batch whose ``seq`` skips numbers, or of an incarnation the
index never saw start, leaves the instance ``stale`` (its deltas still apply; an unknown
incarnation first drops what the old one held) until a full batch replaces its set.
:class:`ResyncTracker` says when to ask an agent for that full batch (once, again after a
timeout). A failed or departed instance is dropped, and later batches of the same incarnation
are ignored, and so are those of an incarnation a full batch of a newer one replaced. A
malformed batch (negative ``seq``, bad block size, hashes out of range) is
rejected and counted. Pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from schemas.kv_events import KVCacheEvents, KVSyncReason

__all__ = [
    "PREFIX_HITS_KEPT",
    "ApplyOutcome",
    "IndexSnapshot",
    "InstanceEntry",
    "PrefixIndex",
    "ResyncTracker",
    "decode_index",
    "encode_index",
    "prefix_hits",
    "replay_index",
]

_MAX_HASH = (1 << 64) - 1

#: How many instances a dispatch's prefix lookup keeps (and its ``Dispatched`` event records):
#: those holding the most leading blocks of the request's chain. Bounds the event and the lookup
#: when a prefix is cached on many instances.
PREFIX_HITS_KEPT = 32


class ApplyOutcome(enum.StrEnum):
    """What :meth:`PrefixIndex.apply` did with a batch."""

    APPLIED = "applied"
    #: a full batch replaced the instance's set (it is no longer stale)
    REPLACED = "replaced"
    #: a stream sequence already applied, or a batch ``seq`` not after the last one: nothing changed
    REPEAT = "repeat"
    #: applied, but ``seq`` skipped numbers: the instance is stale until a full batch
    GAP = "gap"
    #: applied over an empty set (an incarnation never seen start): stale until a full batch
    UNKNOWN_INCARNATION = "unknown_incarnation"
    #: the incarnation was dropped (failed or left): ignored
    DEPARTED = "departed"
    MALFORMED = "malformed"


#: Outcomes after which the instance needs a full batch, and the reason to give its agent.
SYNC_REASONS: dict[ApplyOutcome, KVSyncReason] = {
    ApplyOutcome.GAP: KVSyncReason.GAP,
    ApplyOutcome.UNKNOWN_INCARNATION: KVSyncReason.UNKNOWN_INCARNATION,
}


class InstanceEntry(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One instance in a snapshot of the index (hashes sorted)."""

    instance_id: str
    incarnation: str
    seq: int
    block_size: int
    stale: bool = False
    #: its bit in the holder masks (the order the index first saw it: the tie-break of overlap)
    slot: int = -1
    hashes: tuple[int, ...] = ()


class IndexSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The whole index: instances by id, the incarnations dropped, the last stream sequence."""

    kv_seq: int = 0
    instances: tuple[InstanceEntry, ...] = ()
    #: (instance id, incarnation) of instances dropped on failure or departure
    departed: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class _Instance:
    slot: int
    incarnation: str
    seq: int
    block_size: int
    hashes: set[int] = field(default_factory=set)
    stale: bool = False


def _malformed(batch: KVCacheEvents) -> bool:
    if batch.seq < 1 or batch.block_size < 1 or not batch.instance_id or not batch.incarnation:
        return True
    return any(not 0 <= h <= _MAX_HASH for h in batch.stored) or any(
        not 0 <= h <= _MAX_HASH for h in batch.removed
    )


class PrefixIndex:
    """Instance → cached block hashes and hash → holders; see the module docstring."""

    def __init__(self) -> None:
        self._instances: dict[str, _Instance] = {}
        #: hash → bit mask of the slots of the instances holding it
        self._holders: dict[int, int] = {}
        #: block size → bit mask of the slots of the instances with that block size
        self._by_block_size: dict[int, int] = {}
        self._slot_ids: list[str | None] = []
        self._free_slots: list[int] = []
        self._departed: dict[str, str] = {}
        #: the last ``<prefix>_kv`` stream sequence applied (0: none)
        self.kv_seq = 0
        self.num_batches = 0
        self.num_malformed = 0
        self.num_gaps = 0
        self.num_unknown_incarnations = 0
        self.num_ignored = 0

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._instances)

    @property
    def num_entries(self) -> int:
        """(instance, hash) pairs held."""
        return sum(len(entry.hashes) for entry in self._instances.values())

    @property
    def num_hashes(self) -> int:
        """Distinct hashes held by any instance."""
        return len(self._holders)

    def instance_ids(self) -> list[str]:
        return sorted(self._instances)

    def hashes_of(self, instance_id: str) -> frozenset[int]:
        entry = self._instances.get(instance_id)
        return frozenset() if entry is None else frozenset(entry.hashes)

    def is_stale(self, instance_id: str) -> bool:
        entry = self._instances.get(instance_id)
        return entry is not None and entry.stale

    def stale_instances(self) -> list[str]:
        return sorted(key for key, entry in self._instances.items() if entry.stale)

    def overlap(self, chain: Iterable[int], *, block_size: int, limit: int | None = None) -> dict[str, int]:
        """Per instance of ``block_size`` holding the chain's first block, how many leading blocks
        of ``chain`` it holds (instances holding none are left out), best first. One lookup and
        one AND per block; with ``limit`` only the ``limit`` instances holding the most, ties
        going to the instance the index saw first (its slot, kept in snapshots)."""
        mask = self._by_block_size.get(block_size, 0)
        holders = self._holders
        drops: list[tuple[int, int]] = []  # (blocks held, mask of the instances holding that many)
        num_blocks = 0
        for block_hash in chain:
            held = holders.get(block_hash, 0) & mask
            if held != mask:
                if num_blocks:
                    drops.append((num_blocks, mask & ~held))
                mask = held
                if not mask:
                    break
            num_blocks += 1
        if mask and num_blocks:
            drops.append((num_blocks, mask))
        result: dict[str, int] = {}
        room = len(self._slot_ids) if limit is None else limit
        slot_ids = self._slot_ids
        for num_blocks, group in reversed(drops):
            while group and room > 0:
                low = group & -group
                instance_id = slot_ids[low.bit_length() - 1]
                assert instance_id is not None
                result[instance_id] = num_blocks
                group ^= low
                room -= 1
            if room <= 0:
                break
        return result

    # -- folding ---------------------------------------------------------------------------
    def apply(self, batch: KVCacheEvents, kv_seq: int = 0) -> ApplyOutcome:
        """Fold one batch found at ``kv_seq`` of the kv stream (0: no stream position)."""
        if kv_seq:
            if kv_seq <= self.kv_seq:
                return ApplyOutcome.REPEAT
            self.kv_seq = kv_seq
        if _malformed(batch):
            self.num_malformed += 1
            return ApplyOutcome.MALFORMED
        instance_id = batch.instance_id
        if self._departed.get(instance_id) == batch.incarnation:
            self.num_ignored += 1
            return ApplyOutcome.DEPARTED
        entry = self._instances.get(instance_id)
        self.num_batches += 1
        if batch.full:
            if entry is not None and entry.incarnation == batch.incarnation and batch.seq <= entry.seq:
                return ApplyOutcome.REPEAT
            self._departed.pop(instance_id, None)
            if entry is not None and entry.incarnation != batch.incarnation:
                self._departed[instance_id] = entry.incarnation  # a new process: the old one's late batches
            entry = self._reset(instance_id, batch)
            self._store(entry, batch.stored)
            return ApplyOutcome.REPLACED
        if entry is None or entry.incarnation != batch.incarnation:
            self._departed.pop(instance_id, None)
            entry = self._reset(instance_id, batch)
            entry.stale = True
            self._store(entry, batch.stored)
            self.num_unknown_incarnations += 1
            return ApplyOutcome.UNKNOWN_INCARNATION
        if batch.seq <= entry.seq:
            return ApplyOutcome.REPEAT
        gap = batch.seq != entry.seq + 1
        entry.seq = batch.seq
        self._remove(entry, batch.removed)
        self._store(entry, batch.stored)
        if gap:
            entry.stale = True
            self.num_gaps += 1
            return ApplyOutcome.GAP
        return ApplyOutcome.APPLIED

    def reject(self, kv_seq: int = 0) -> None:
        """A kv-stream entry that is not a batch (undecodable, another message): counted, skipped."""
        self.kv_seq = max(self.kv_seq, kv_seq)
        self.num_malformed += 1

    def drop(self, instance_id: str) -> bool:
        """Forget an instance that failed or left; later batches of its incarnation are ignored."""
        entry = self._instances.pop(instance_id, None)
        if entry is None:
            return False
        self._departed[instance_id] = entry.incarnation
        self._release(entry)
        return True

    def _reset(self, instance_id: str, batch: KVCacheEvents, slot: int = -1) -> _Instance:
        """An empty entry for ``batch``'s incarnation (the old one's hashes released), in the
        lowest free slot or (a snapshot's) in ``slot``."""
        old = self._instances.pop(instance_id, None)
        if old is not None:
            self._release(old)
        if slot < 0:
            slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slot_ids)
        elif slot in self._free_slots:
            self._free_slots.remove(slot)
            heapq.heapify(self._free_slots)
        while len(self._slot_ids) <= slot:
            if len(self._slot_ids) < slot:
                heapq.heappush(self._free_slots, len(self._slot_ids))
            self._slot_ids.append(None)
        self._slot_ids[slot] = instance_id
        entry = _Instance(
            slot=slot, incarnation=batch.incarnation, seq=batch.seq, block_size=batch.block_size
        )
        self._instances[instance_id] = entry
        bit = 1 << slot
        self._by_block_size[batch.block_size] = self._by_block_size.get(batch.block_size, 0) | bit
        return entry

    def _release(self, entry: _Instance) -> None:
        self._remove(entry, list(entry.hashes))
        bit = 1 << entry.slot
        remaining = self._by_block_size.get(entry.block_size, 0) & ~bit
        if remaining:
            self._by_block_size[entry.block_size] = remaining
        else:
            self._by_block_size.pop(entry.block_size, None)
        self._slot_ids[entry.slot] = None
        heapq.heappush(self._free_slots, entry.slot)

    def _store(self, entry: _Instance, hashes: Iterable[int]) -> None:
        bit = 1 << entry.slot
        holders, own = self._holders, entry.hashes
        for block_hash in hashes:
            if block_hash not in own:
                own.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def _remove(self, entry: _Instance, hashes: Iterable[int]) -> None:
        clear = ~(1 << entry.slot)
        holders, own = self._holders, entry.hashes
        for block_hash in hashes:
            if block_hash in own:
                own.discard(block_hash)
                if remaining := holders[block_hash] & clear:
                    holders[block_hash] = remaining
                else:
                    del holders[block_hash]

    # -- snapshots -------------------------------------------------------------------------
    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(
            kv_seq=self.kv_seq,
            instances=tuple(
                InstanceEntry(
                    instance_id=key,
                    incarnation=entry.incarnation,
                    seq=entry.seq,
                    block_size=entry.block_size,
                    stale=entry.stale,
                    slot=entry.slot,
                    hashes=tuple(sorted(entry.hashes)),
                )
                for key, entry in sorted(self._instances.items())
            ),
            departed=tuple(sorted(self._departed.items())),
        )

    @classmethod
    def from_snapshot(cls, snapshot: IndexSnapshot) -> PrefixIndex:
        index = cls()
        index.kv_seq = snapshot.kv_seq
        for item in snapshot.instances:
            batch = KVCacheEvents(
                instance_id=item.instance_id,
                incarnation=item.incarnation,
                seq=item.seq,
                block_size=item.block_size,
            )
            entry = index._reset(item.instance_id, batch, slot=item.slot)
            entry.stale = item.stale
            index._store(entry, item.hashes)
        index._departed = dict(snapshot.departed)
        return index


def prefix_hits(
    index: PrefixIndex, chain: Iterable[int], *, block_size: int, eligible: Callable[[str], bool]
) -> tuple[tuple[str, int], ...]:
    """What a dispatch records of ``chain``: per ``eligible`` instance of ``block_size``, the
    leading blocks of the chain its cache holds, among the :data:`PREFIX_HITS_KEPT` instances
    holding most (only those holding some, by id). The live scheduler and the simulator both
    fill ``PendingRequest.cached_tokens`` from it."""
    if block_size < 1:
        return ()
    found = index.overlap(chain, block_size=block_size, limit=PREFIX_HITS_KEPT)
    return tuple(sorted((key, n) for key, n in found.items() if eligible(key)))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(IndexSnapshot)


def encode_index(index: PrefixIndex) -> bytes:
    return _encoder.encode(index.snapshot())


def decode_index(data: bytes) -> PrefixIndex:
    """The index ``data`` holds (b"": an empty one); ``ValueError`` if it does not decode."""
    if not data:
        return PrefixIndex()
    try:
        return PrefixIndex.from_snapshot(_decoder.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"prefix index snapshot does not decode: {exc}") from exc


def replay_index(
    batches: Iterable[tuple[int, KVCacheEvents]], start: PrefixIndex | None = None
) -> PrefixIndex:
    """Fold ``(kv stream sequence, batch)`` pairs in order onto ``start`` (changed in place) or
    an empty index."""
    index = PrefixIndex() if start is None else start
    for kv_seq, batch in batches:
        index.apply(batch, kv_seq)
    return index


@dataclass(slots=True)
class ResyncTracker:
    """When to ask a stale instance's agent for a full batch: at once, then again every
    ``retry_s`` while it stays stale (an ask or its full batch may be lost)."""

    retry_s: float = 5.0
    _asked: dict[str, float] = field(default_factory=dict)
    num_asked: int = 0

    def due(self, stale: Iterable[str], now: float) -> list[str]:
        """The instances to ask now among ``stale`` (every stale one; the others are forgotten)."""
        stale_ids = set(stale)
        for instance_id in [key for key in self._asked if key not in stale_ids]:
            del self._asked[instance_id]
        due = sorted(key for key in stale_ids if now - self._asked.get(key, float("-inf")) >= self.retry_s)
        for instance_id in due:
            self._asked[instance_id] = now
        self.num_asked += len(due)
        return due
