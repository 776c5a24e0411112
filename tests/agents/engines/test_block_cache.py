"""The block manager's prefix cache: sharing, LRU eviction from the free pool, the net cache delta,
and the chained block hashes every party computes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from agents.engines.block_manager import BlockManager, BlockStateError, OutOfBlocks
from schemas.block_hash import HASH_MASK, block_hashes, extend_block_hashes, root_hash

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ hashes


@given(st.lists(st.integers(0, 50_000), max_size=80), st.lists(st.integers(0, 50_000), max_size=40))
@settings(max_examples=60, deadline=None)
def test_a_chain_is_a_prefix_of_every_longer_prompts_chain(head: list[int], tail: list[int]) -> None:
    short = block_hashes(head, 8)
    assert len(short) == len(head) // 8  # one hash per full block, none for a partial one
    assert block_hashes(head + tail, 8)[: len(short)] == short
    assert all(0 <= h <= HASH_MASK for h in short)
    grown = extend_block_hashes(list(short), head + tail, 8, root_hash(8))
    assert grown == block_hashes(head + tail, 8)


def test_a_block_hash_names_its_whole_prefix_not_only_its_tokens() -> None:
    same_block = [7] * 8
    first = block_hashes([1] * 8 + same_block, 8)
    second = block_hashes([2] * 8 + same_block, 8)
    assert first[1] != second[1]  # equal tokens after different prefixes are different KV
    assert block_hashes(same_block, 8) != block_hashes(same_block, 4)[:1]
    assert block_hashes(same_block, 8, salt="tenant-a") != block_hashes(same_block, 8, salt="tenant-b")
    with pytest.raises(ValueError, match="block_size"):
        root_hash(0)


# ------------------------------------------------------------- block cache


def test_a_freed_cached_block_stays_findable_and_counts_as_free_until_evicted() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, prefix_cache=True)
    table = bm.allocate(3)
    for index, block_id in enumerate(table):
        assert bm.cache_block(block_id, 100 + index)
    bm.free(table)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3 and bm.num_evictable_blocks == 3
    assert bm.lookup([100, 101, 102, 999]) == table  # the longest cached prefix
    assert bm.lookup([101]) == [table[1]]
    bm.share(bm.lookup([100, 101]))
    assert bm.num_free_blocks == 2 and bm.ref_count(table[0]) == 1
    # Two blocks left to take: the never-cached one, then the least recently freed cached one,
    # which is the request's tail (its blocks were freed in reverse).
    taken = bm.allocate(2)
    assert taken[1] == table[2] and bm.lookup([100, 101, 102]) == table[:2]
    assert bm.num_evictions == 1
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)
    bm.check_invariants()


def test_the_cache_delta_is_net_and_reports_each_hash_once() -> None:
    bm = BlockManager(num_blocks=2, block_size=4, prefix_cache=True)
    [a, b] = bm.allocate(2)
    bm.cache_block(a, 1)
    bm.cache_block(b, 2)
    assert set(bm.take_cache_delta().stored) == {1, 2}
    assert not bm.take_cache_delta()
    bm.free([a, b])
    bm.allocate(1)  # evicts hash 2 (the tail), then it is stored again under another block
    [c] = bm.allocate(1)
    assert bm.take_cache_delta().removed == (2, 1)
    bm.cache_block(c, 2)
    delta = bm.take_cache_delta()
    assert delta.stored == (2,) and delta.removed == ()
    bm.free([c])
    [d] = bm.allocate(1)
    bm.cache_block(d, 2)  # removed and stored again between two takes: no change to report
    assert not bm.take_cache_delta()


def test_cache_rules_refuse_what_would_corrupt_the_cache() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, prefix_cache=True)
    [a, b] = bm.allocate(2)
    assert bm.cache_block(a, 5)
    assert not bm.cache_block(b, 5)  # another block holds this KV already: the first one stays
    assert not bm.cache_block(a, 6)  # a cached block keeps its hash
    with pytest.raises(BlockStateError):
        bm.share([b])  # not cached
    [c] = bm.allocate(1)
    bm.free([c])
    with pytest.raises(BlockStateError):
        bm.cache_block(c, 7)  # free: its KV is gone
    off = BlockManager(num_blocks=2, block_size=4)
    [x] = off.allocate(1)
    assert not off.cache_block(x, 1) and off.lookup([1]) == [] and not off.take_cache_delta()


def test_clearing_the_cache_keeps_blocks_in_use_and_frees_the_rest() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, prefix_cache=True)
    [a, b] = bm.allocate(2)
    bm.cache_block(a, 1)
    bm.cache_block(b, 2)
    bm.free([b])
    assert bm.clear_cache() == 2
    assert bm.lookup([1]) == [] and bm.ref_count(a) == 1 and bm.num_free_blocks == 2
    delta = bm.take_cache_delta()
    assert delta.cleared and delta.stored == ()
    bm.check_invariants()


class CachedPoolMachine(RuleBasedStateMachine):
    """Random sequences of allocate / cache / share / free / reserve against the invariants, and
    the published cache (the deltas applied in order) against what the cache really holds."""

    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=4, prefix_cache=True)
        self.published: set[int] = set()
        self.next_hash = 1
        self.live: list[list[int]] = []

    @rule(target=tables, n=st.integers(1, 4))
    def allocate(self, n: int) -> list[int]:
        try:
            table = self.bm.allocate(n)
        except OutOfBlocks:
            return []
        self.live.append(table)
        return table

    @rule(table=tables)
    def cache(self, table: list[int]) -> None:
        if table in self.live:
            for block_id in table:
                if self.bm.cache_block(block_id, self.next_hash):
                    self.next_hash += 1

    @rule(target=tables, table=tables)
    def share_prefix(self, table: list[int]) -> list[int]:
        hashes = [self.bm.block_hash(b) for b in table]
        chain = [h for h in hashes if h is not None][:2]
        hit = self.bm.lookup(chain)
        self.bm.share(hit)
        if hit:
            self.live.append(hit)
        return hit

    @rule(table=consumes(tables))
    def free(self, table: list[int]) -> None:
        if table in self.live:
            self.live.remove(table)
            self.bm.free(table)

    @rule(n=st.integers(0, 5), commit=st.booleans())
    def reserve(self, n: int, commit: bool) -> None:
        try:
            reservation = self.bm.reserve(n)
        except OutOfBlocks:
            return
        if commit:
            self.live.append(list(self.bm.commit(reservation.reservation_id)))
        else:
            self.bm.release(reservation.reservation_id)

    @rule()
    def publish(self) -> None:
        delta = self.bm.take_cache_delta()
        assert not set(delta.stored) & set(delta.removed)
        assert not set(delta.stored) & self.published and set(delta.removed) <= self.published
        self.published |= set(delta.stored)
        self.published -= set(delta.removed)
        assert self.published == set(self.bm.cached_hashes())

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for table in self.live:
            assert all(self.bm.ref_count(b) > 0 for b in table)  # a block in use is never freed
        assert self.bm.num_free_blocks + self.bm.num_allocated_blocks + self.bm.num_reserved_blocks == 12


CachedPoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_cached_pool_machine = CachedPoolMachine.TestCase
