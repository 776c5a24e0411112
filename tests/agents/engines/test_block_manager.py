"""The block manager: exact accounting over allocate / free / reserve / commit / release."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from agents.engines.block_manager import (
    BlockManager,
    BlockStateError,
    OutOfBlocks,
    UnknownReservation,
)


def test_fresh_manager_hands_out_blocks_in_order_and_counts_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert (bm.num_free_blocks, bm.num_allocated_blocks, bm.num_reserved_blocks) == (3, 5, 0)
    assert bm.blocks_for_tokens(0) == 0
    assert bm.blocks_for_tokens(16) == 1
    assert bm.blocks_for_tokens(17) == 2


def test_allocation_beyond_free_blocks_takes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        bm.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_freed_blocks_are_reused_and_a_double_free_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.allocate(2)
    bm.free(table)
    assert bm.num_free_blocks == 4
    with pytest.raises(BlockStateError, match="not allocated"):
        bm.free(table)
    other = bm.allocate(1)
    with pytest.raises(BlockStateError):
        bm.free([*other, *other])  # the second reference does not exist
    assert bm.num_allocated_blocks == 1
    with pytest.raises(BlockStateError, match="out of range"):
        bm.free([99])
    bm.check_invariants()


def test_reservation_is_neither_free_nor_allocated_until_committed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    res = bm.reserve(4)
    assert res.num_blocks == 4
    assert (bm.num_free_blocks, bm.num_reserved_blocks, bm.num_allocated_blocks) == (6, 4, 0)
    assert all(bm.reservation_of(b) == res.reservation_id for b in res.block_ids)
    with pytest.raises(BlockStateError, match="reserved"):
        bm.free(res.block_ids[:1])
    assert bm.commit(res.reservation_id) == res.block_ids
    assert (bm.num_free_blocks, bm.num_reserved_blocks, bm.num_allocated_blocks) == (6, 0, 4)
    with pytest.raises(UnknownReservation):
        bm.commit(res.reservation_id)
    bm.free(res.block_ids)
    assert bm.num_free_blocks == 10


def test_released_reservation_returns_its_blocks() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    res = bm.reserve(5)
    with pytest.raises(OutOfBlocks):
        bm.reserve(1)
    assert bm.release(res.reservation_id) == 5
    assert bm.num_free_blocks == 5
    with pytest.raises(UnknownReservation):
        bm.release(res.reservation_id)
    assert bm.reservations() == ()


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(4, 4).allocate(-1)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences against a model: who holds which block, and what is reserved."""

    NUM_BLOCKS = 24

    tables = Bundle("tables")
    reservations = Bundle("reservations")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, block_size=4)
        self.held: dict[int, set[int]] = {}  # table key -> blocks
        self.reserved: dict[int, set[int]] = {}  # reservation id -> blocks
        self.next_key = 0

    def _handed_out(self) -> set[int]:
        return set().union(*self.held.values(), *self.reserved.values())

    @rule(target=tables, n=st.integers(0, 10))
    def allocate(self, n: int) -> int:
        free_before = self.bm.num_free_blocks
        key = self.next_key
        self.next_key += 1
        if n > free_before:
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(n)
            self.held[key] = set()
            return key
        ids = self.bm.allocate(n)
        assert len(ids) == len(set(ids)) == n
        assert not set(ids) & self._handed_out(), "a block was handed out twice"
        self.held[key] = set(ids)
        return key

    @rule(key=consumes(tables))
    def free(self, key: int) -> None:
        self.bm.free(sorted(self.held.pop(key)))

    @rule(target=reservations, n=st.integers(0, 10))
    def reserve(self, n: int) -> int:
        if n > self.bm.num_free_blocks:
            with pytest.raises(OutOfBlocks):
                self.bm.reserve(n)
            return -1
        res = self.bm.reserve(n)
        assert not set(res.block_ids) & self._handed_out()
        self.reserved[res.reservation_id] = set(res.block_ids)
        return res.reservation_id

    @rule(target=tables, rid=consumes(reservations))
    def commit(self, rid: int) -> int:
        key = self.next_key
        self.next_key += 1
        if rid < 0:
            self.held[key] = set()
            return key
        ids = self.bm.commit(rid)
        assert set(ids) == self.reserved.pop(rid)
        self.held[key] = set(ids)
        return key

    @rule(rid=consumes(reservations))
    def release(self, rid: int) -> None:
        if rid < 0:
            with pytest.raises(UnknownReservation):
                self.bm.release(rid)
            return
        assert self.bm.release(rid) == len(self.reserved.pop(rid))

    @invariant()
    def accounting_matches_the_model(self) -> None:
        bm = self.bm
        bm.check_invariants()
        num_held = sum(len(b) for b in self.held.values())
        num_reserved = sum(len(b) for b in self.reserved.values())
        assert bm.num_allocated_blocks == num_held
        assert bm.num_reserved_blocks == num_reserved
        assert bm.num_free_blocks == self.NUM_BLOCKS - num_held - num_reserved
        assert bm.num_free_blocks >= 0


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
