"""vLLM's KV cache events folded into shoal's block hashes (``VllmCacheIndex``).

The hashes the index reports must be :func:`schemas.block_hash.block_hashes` of the cached
tokens, whatever vLLM's own hashes are; a prefix vLLM caches twice stays until its last block
goes; what cannot be named is left out, never guessed. The events here carry the fields of
vLLM's ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` (``vllm.distributed.kv_events``),
without importing vLLM; ``test_vllm_engine.py`` folds vLLM's real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agents.engines.vllm_engine.prefix_cache import VllmCacheIndex
from schemas.block_hash import block_hashes

SIZE = 4
TOKENS = tuple(range(100, 116))  # four blocks of 4


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list[int]


class AllBlocksCleared:
    pass


def _stored(
    vllm_hashes: list[int], parent: int | None, tokens: tuple[int, ...], size: int = SIZE
) -> BlockStored:
    return BlockStored(vllm_hashes, parent, list(tokens), size)


def test_stored_blocks_are_named_by_shoals_chain_across_events() -> None:
    chain = block_hashes(TOKENS, SIZE)
    index = VllmCacheIndex(SIZE)
    index.fold([_stored([901, 902], None, TOKENS[:8])])  # a prompt's first two blocks
    index.fold([_stored([903, 904], 902, TOKENS[8:])])  # later blocks chain from their parent
    assert index.take_delta().stored == tuple(chain)
    assert sorted(index.hashes()) == sorted(chain)
    index.fold([BlockRemoved([904])])
    delta = index.take_delta()
    assert delta.removed == (chain[3],) and not delta.stored
    assert index.num_evictions == 1
    index.fold([_stored([905], None, TOKENS[:4]), BlockRemoved([905])])  # stored and evicted in between
    assert not index.take_delta()


def test_a_prefix_cached_twice_stays_until_its_last_block_is_removed() -> None:
    chain = block_hashes(TOKENS[:4], SIZE)
    index = VllmCacheIndex(SIZE)
    index.fold([_stored([901], None, TOKENS[:4]), _stored([901], None, TOKENS[:4])])  # two requests at once
    assert index.take_delta().stored == tuple(chain)
    index.fold([BlockRemoved([901])])
    assert not index.take_delta() and index.hashes() == chain
    index.fold([BlockRemoved([901])])
    assert index.take_delta().removed == tuple(chain) and index.hashes() == []


def test_what_cannot_be_named_is_left_out() -> None:
    index = VllmCacheIndex(SIZE)
    index.fold([_stored([903], 999, TOKENS[8:12])])  # parent never seen
    index.fold([_stored([901], None, TOKENS[:3], size=3)])  # another block size
    index.fold([BlockStored([906], None, list(TOKENS[:4]), SIZE, group_idx=1)])  # another KV cache group
    index.fold([BlockRemoved([777])])  # never stored
    assert not index.take_delta() and index.hashes() == []
    assert index.num_unmapped == 3 and index.num_evictions == 0


def test_a_reset_clears_and_a_resync_drops_blocks_vllm_no_longer_holds() -> None:
    chain = block_hashes(TOKENS, SIZE)
    index = VllmCacheIndex(SIZE)
    index.fold([_stored([901, 902], None, TOKENS[:8]), AllBlocksCleared()])
    index.fold([_stored([901], None, TOKENS[:4])])
    delta = index.take_delta()
    assert delta.cleared and delta.stored == (chain[0],)
    index.fold([_stored([902], 901, TOKENS[4:8])])
    assert index.reconcile([901]) == 1  # the pool holds only the first block
    assert index.hashes() == [chain[0]] and not index.take_delta()  # stored, then dropped: no change
    index.fold([_stored([902], 901, TOKENS[4:8])])
    index.take_delta()
    assert index.reconcile([901]) == 1 and index.take_delta().removed == (chain[1],)
    assert index.num_evictions == 0


def _hasher(parent: object, tokens: Sequence[int]) -> tuple[object, int]:
    """A stand-in for vLLM's hash function: the key chains, the name is 1000 + the first token."""
    return (parent, tuple(tokens)), 1000 + tokens[0]


def test_vllms_own_key_of_a_block_is_kept_only_where_the_hasher_reproduces_its_name() -> None:
    chain = block_hashes(TOKENS, SIZE)
    index = VllmCacheIndex(SIZE, _hasher)
    index.fold([_stored([1100], None, TOKENS[:4]), _stored([1104], 1100, TOKENS[4:8])])
    first = (None, TOKENS[:4])
    assert index.vllm_key(chain[0]) == first and index.vllm_key(chain[1]) == (first, TOKENS[4:8])
    index.fold([_stored([5], 1104, TOKENS[8:12])])  # named otherwise by vLLM: no key, still cached
    assert index.vllm_key(chain[2]) is None and chain[2] in index.hashes()
    index.fold([BlockRemoved([1100])])
    assert index.vllm_key(chain[0]) is None
