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
a block returns to the free list when its count reaches zero. Shared prefix
blocks can therefore be added later (a ``share(block_ids)`` that increments
counts) without changing any caller.

What does not live here: which request owns which blocks (the local
scheduler's request records), admission and preemption (the local scheduler),
and the KV tensors themselves (the engines).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "BlockStateError",
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
        "_free",
        "_next_reservation_id",
        "_num_allocated",
        "_num_reserved",
        "_ref_counts",
        "_reservations",
        "_reserved_by",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
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

    # ---------------------------------------------------------------- sizes

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        return num_blocks <= len(self._free)

    # ------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        free = self._free
        if num_blocks > len(free):
            raise OutOfBlocks(num_blocks, len(free))
        if num_blocks == 0:
            return []
        taken = free[-num_blocks:]
        del free[-num_blocks:]
        taken.reverse()
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
        # Free in reverse so a table freed and reallocated gets the same ids back in order.
        for block_id in reversed(ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                self._free.append(block_id)
                self._num_allocated -= 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---------------------------------------------------------- reservations

    def reserve(self, num_blocks: int) -> Reservation:
        """Set ``num_blocks`` free blocks aside for an incoming migration; all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        free = self._free
        if num_blocks > len(free):
            raise OutOfBlocks(num_blocks, len(free))
        taken: list[int] = []
        if num_blocks:
            taken = free[-num_blocks:]
            del free[-num_blocks:]
            taken.reverse()
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
