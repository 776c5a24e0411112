"""The KV block pool of one engine instance: pure block accounting, no tensors.

Every block is in exactly one of three states:

* **free** — on the free list, available to ``allocate`` and ``reserve``;
* **allocated** — held by one or more requests (a reference count; 1 while no block is shared);
* **reserved** — set aside by ``reserve`` for an incoming migration, owned by a
  :class:`Reservation` until ``commit`` makes its blocks allocated or
  ``release`` returns them to the free list.

So ``num_free + num_allocated + num_reserved == num_total`` always holds.

Callers keep their own block tables (a request's list of block ids) and hand
block ids back to :meth:`BlockManager.free`. ``free`` *drops one reference*:
a block returns to the free list when its count reaches zero.

**Prefix caching** (``prefix_cache=True``, vLLM's automatic prefix caching): a full block
whose KV is computed is registered under its chained hash (:mod:`schemas.block_hash`) with
:meth:`cache_block`. A later request finds its prompt's cached blocks with :meth:`lookup`
and takes a reference to them with :meth:`share` instead of computing them again. A cached
block whose count drops to zero is not wiped: it waits, still findable, on an LRU list
(*evictable*) and counts as free; :meth:`allocate` and :meth:`reserve` take never-cached
free blocks first, then evict the least recently freed cached ones (a request's tail blocks
before its head, as its blocks are freed in reverse). So the cache's capacity is the free
pool and a cached block never costs a request its admission. A cached block is never
written: a request computes only the positions after its cached prefix, which live in
blocks of its own.

What the cache gained and lost since the last :meth:`take_cache_delta` is kept as a net
delta (a hash stored then evicted in between is in neither list), for the agent's cache
events; :meth:`cached_hashes` is the full set, for a re-sync.

What does not live here: which request owns which blocks (the local
scheduler's request records), admission and preemption (the local scheduler),
and the KV tensors themselves (the engines).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agents.engines.cache_delta import CacheDelta, DeltaRecorder

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "BlockStateError",
    "CacheDelta",
    "OutOfBlocks",
    "Reservation",
    "UnknownReservation",
]


class BlockManagerError(Exception):
    """Base of the block manager's errors."""


class OutOfBlocks(BlockManagerError):
    """Fewer free blocks than asked for (nothing was taken)."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} blocks, {free} free")
        self.requested = requested
        self.free = free


class UnknownReservation(BlockManagerError, KeyError):
    """No live reservation has this id (never made, committed or released)."""

    def __str__(self) -> str:
        return f"unknown reservation {self.args[0]!r}"


class BlockStateError(BlockManagerError):
    """A block id that is out of range or not allocated (e.g. a double free)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """Blocks set aside for an incoming migration, in the order they were handed out."""

    reservation_id: int
    block_ids: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    Allocation is LIFO from a free list, so it is O(blocks asked for) and
    deterministic: a fresh manager hands out block 0, 1, 2, ...
    """

    __slots__ = (
        "_block_size",
        "_by_hash",
        "_delta",
        "_evictable",
        "_free",
        "_hash_of",
        "_next_reservation_id",
        "_num_allocated",
        "_num_reserved",
        "_ref_counts",
        "_reservations",
        "_reserved_by",
        "num_evictions",
        "prefix_cache",
    )

    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks
        self._reserved_by: dict[int, int] = {}
        self._reservations: dict[int, Reservation] = {}
        self._next_reservation_id = 1
        self._num_allocated = 0
        self._num_reserved = 0
        self.prefix_cache = prefix_cache
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._evictable: dict[int, None] = {}  # cached blocks with no reference, least recently freed first
        self._delta = DeltaRecorder()
        self.num_evictions = 0

    # ---------------------------------------------------------------- sizes

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: never-cached free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._by_hash)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_allocated_blocks(self) -> int:
        return self._num_allocated

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV cache."""
        return -(-num_tokens // self._block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ------------------------------------------------------------ allocation

    def _take(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the free pool: never-cached ones first (LIFO), then the
        least recently freed cached ones, which leave the cache; all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        free = self._free
        available = len(free) + len(self._evictable)
        if num_blocks > available:
            raise OutOfBlocks(num_blocks, available)
        if num_blocks == 0:
            return []
        from_free = min(num_blocks, len(free))
        taken = free[len(free) - from_free :]
        del free[len(free) - from_free :]
        taken.reverse()
        if from_free < num_blocks:
            evictable = self._evictable
            for _ in range(num_blocks - from_free):
                block_id = next(iter(evictable))
                del evictable[block_id]
                self._uncache(block_id)
                self.num_evictions += 1
                taken.append(block_id)
        return taken

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each); all or nothing."""
        taken = self._take(num_blocks)
        if not taken:
            return []
        ref_counts = self._ref_counts
        for block_id in taken:
            ref_counts[block_id] = 1
        self._num_allocated += num_blocks
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block with none left becomes free.

        Raises :class:`BlockStateError` (before changing anything) for a block
        that is not allocated, including a block listed twice beyond its count.
        """
        ids = list(block_ids)
        ref_counts = self._ref_counts
        num_total = len(ref_counts)
        drops: dict[int, int] = {}
        for block_id in ids:
            if not 0 <= block_id < num_total:
                raise BlockStateError(f"block {block_id} is out of range 0..{num_total - 1}")
            drops[block_id] = drops.get(block_id, 0) + 1
        for block_id, count in drops.items():
            if ref_counts[block_id] < count:
                state = "reserved" if block_id in self._reserved_by else "free"
                raise BlockStateError(f"block {block_id} is {state}, not allocated; cannot free it")
        # Free in reverse so a table freed and reallocated gets the same ids back in order, and a
        # cached request's tail blocks are evicted before its head.
        hash_of = self._hash_of
        for block_id in reversed(ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                if hash_of[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None
                self._num_allocated -= 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---------------------------------------------------------- prefix cache

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of the chain ``hashes`` (no reference taken)."""
        by_hash = self._by_hash
        found: list[int] = []
        for block_hash in hashes:
            block_id = by_hash.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_evictable_among(self, block_ids: Iterable[int]) -> int:
        """How many of these (cached) blocks sit unreferenced on the LRU list: sharing them takes
        them out of the free pool."""
        evictable = self._evictable
        return sum(1 for block_id in block_ids if block_id in evictable)

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each cached block (from :meth:`lookup`); an evictable one
        leaves the LRU list and is allocated again."""
        ref_counts = self._ref_counts
        for block_id in block_ids:
            if self._hash_of[block_id] is None:
                raise BlockStateError(f"block {block_id} is not cached; only cached blocks are shared")
            if ref_counts[block_id] == 0:
                del self._evictable[block_id]
                self._num_allocated += 1
            ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register an allocated block whose KV is complete under its chain hash; False (nothing
        changes) if the cache is off, the block is already cached, or another block holds this
        hash (the first one stays)."""
        if not self.prefix_cache or self._hash_of[block_id] is not None or block_hash in self._by_hash:
            return False
        if self._ref_counts[block_id] <= 0:
            raise BlockStateError(f"block {block_id} is not allocated; only allocated blocks are cached")
        self._hash_of[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        self._delta.stored(block_hash)
        return True

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of[block_id]

    def _uncache(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is None:
            return
        self._hash_of[block_id] = None
        del self._by_hash[block_hash]
        self._delta.removed(block_hash)

    def clear_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their KV, evictable ones become plain free
        blocks); returns how many hashes were dropped."""
        num = len(self._by_hash)
        for block_id in list(self._evictable):
            self._free.append(block_id)
        self._evictable.clear()
        for block_id in self._by_hash.values():
            self._hash_of[block_id] = None
        self._by_hash.clear()
        self._delta.cleared()
        return num

    def cached_hashes(self) -> list[int]:
        """Every hash the cache holds now (for a full re-sync of an index)."""
        return list(self._by_hash)

    def take_cache_delta(self) -> CacheDelta:
        """What the cache gained and lost since the last call (net, each hash once)."""
        return self._delta.take()

    # ---------------------------------------------------------- reservations

    def reserve(self, num_blocks: int) -> Reservation:
        """Set ``num_blocks`` free blocks aside for an incoming migration; all or nothing."""
        taken = self._take(num_blocks)
        reservation = Reservation(self._next_reservation_id, tuple(taken))
        self._next_reservation_id += 1
        self._reservations[reservation.reservation_id] = reservation
        for block_id in taken:
            self._reserved_by[block_id] = reservation.reservation_id
        self._num_reserved += num_blocks
        return reservation

    def reservation(self, reservation_id: int) -> Reservation:
        try:
            return self._reservations[reservation_id]
        except KeyError:
            raise UnknownReservation(reservation_id) from None

    def reservations(self) -> tuple[Reservation, ...]:
        return tuple(sorted(self._reservations.values(), key=lambda r: r.reservation_id))

    def reservation_of(self, block_id: int) -> int | None:
        """The id of the live reservation holding ``block_id``, or None."""
        return self._reserved_by.get(block_id)

    def commit(self, reservation_id: int) -> tuple[int, ...]:
        """Turn a reservation's blocks into allocated blocks (count 1); returns them in order."""
        reservation = self._take_reservation(reservation_id)
        ref_counts = self._ref_counts
        for block_id in reservation.block_ids:
            ref_counts[block_id] = 1
        self._num_allocated += reservation.num_blocks
        return reservation.block_ids

    def release(self, reservation_id: int) -> int:
        """Return a reservation's blocks to the free list; returns how many."""
        reservation = self._take_reservation(reservation_id)
        self._free.extend(reversed(reservation.block_ids))
        return reservation.num_blocks

    def _take_reservation(self, reservation_id: int) -> Reservation:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            raise UnknownReservation(reservation_id)
        for block_id in reservation.block_ids:
            del self._reserved_by[block_id]
        self._num_reserved -= reservation.num_blocks
        return reservation

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Raise AssertionError if the three states do not partition the pool (O(blocks))."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        evictable = set(self._evictable)
        if free & evictable:
            raise AssertionError("a block is both free and evictable")
        if any(self._hash_of[b] is not None for b in free):
            raise AssertionError("a block on the free list still has a hash")
        if any(self._hash_of[b] is None for b in evictable):
            raise AssertionError("an evictable block has no hash")
        hashed = sum(1 for h in self._hash_of if h is not None)
        if hashed != len(self._by_hash) or any(self._hash_of[b] != h for h, b in self._by_hash.items()):
            raise AssertionError("the hash table and the blocks' hashes disagree")
        free |= evictable
        allocated = {b for b, count in enumerate(self._ref_counts) if count > 0}
        reserved = set(self._reserved_by)
        if free & allocated or free & reserved or allocated & reserved:
            raise AssertionError("a block is in two states at once")
        if len(free) + len(allocated) + len(reserved) != self.num_total_blocks:
            raise AssertionError("a block is in no state (leaked)")
        if len(allocated) != self._num_allocated or len(reserved) != self._num_reserved:
            raise AssertionError("state counters drifted from the blocks")
        in_reservations = sum(r.num_blocks for r in self._reservations.values())
        if in_reservations != len(reserved):
            raise AssertionError("reservations and reserved blocks disagree")
