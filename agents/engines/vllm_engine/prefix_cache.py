"""``VllmCacheIndex``: vLLM's own prefix cache named by shoal's block hashes.

vLLM hashes the blocks it caches its own way (its hash function, its seed, extra keys);
the rest of shoal names a block by :mod:`schemas.block_hash`. vLLM's KV cache events say
what it cached and dropped: ``BlockStored`` carries the new blocks' vLLM hashes, their
token ids and the vLLM hash of the block before them, ``BlockRemoved`` the vLLM hashes
dropped, ``AllBlocksCleared`` a reset. :meth:`VllmCacheIndex.fold` turns them into shoal
hashes: a stored block's shoal hash chains from its parent's shoal hash (the chain's root
for a first block) over the event's token ids, and a map from vLLM hash to shoal hash
names a removed block again. The map holds exactly the blocks vLLM has cached, so it
stays as large as vLLM's cache.

vLLM may cache one prefix in two blocks (two requests computed it at once) and stores and
removes each block separately, so a hash counts its blocks and leaves when the last one
does. A stored block whose parent is not known (never seen: it cannot happen while every
event is folded, as a cached block's children are stored while a request holds it) or
whose event does not hold whole blocks of this engine's size is left out and counted in
:attr:`VllmCacheIndex.num_unmapped`: the index then misses a hit, it never names a block
vLLM does not hold. :meth:`VllmCacheIndex.reconcile` checks the map against vLLM's block
pool itself (for a full re-sync).

The net change since the last :meth:`VllmCacheIndex.take_delta` is kept as in
:class:`~agents.engines.block_manager.BlockManager` (a hash stored and removed in between
is in neither list). No vLLM import here: the events are read by their fields.

To find a cached block by its shoal hash (a migration's destination lends the blocks it
caches, :meth:`VllmCacheIndex.vllm_key`), the index also keeps vLLM's own key of each
stored block: ``hasher`` (vLLM's hash function) recomputes it from the parent's key and the
block's token ids, and it is kept only where it gives the hash the event carries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from agents.engines.cache_delta import CacheDelta, DeltaRecorder
from schemas.block_hash import extend_block_hashes, root_hash

__all__ = ["VllmCacheIndex", "VllmHasher"]

#: vLLM's key of a block from its parent's key (None: the first block) and its token ids, with
#: the hash vLLM's events name that key by
VllmHasher = Callable[[Any, Sequence[int]], tuple[Any, Hashable]]

log = logging.getLogger(__name__)


class VllmCacheIndex:
    """Shoal's hashes of the blocks in one vLLM engine's prefix cache; see the module docstring."""

    def __init__(self, block_size: int, hasher: VllmHasher | None = None) -> None:
        self.block_size = block_size
        self._root = root_hash(block_size)
        self._hasher = hasher
        self._shoal: dict[Hashable, int] = {}  # vLLM hash -> shoal hash, for every cached block
        self._vllm: dict[int, Hashable] = {}  # shoal hash -> vLLM hash
        self._key: dict[Hashable, Any] = {}  # vLLM hash -> vLLM's key of the block (with a hasher)
        self._count: dict[Hashable, int] = {}  # vLLM hash -> blocks vLLM caches under it
        self._delta = DeltaRecorder()
        self.num_evictions = 0
        self.num_unmapped = 0

    def __len__(self) -> int:
        return len(self._shoal)

    def shoal_hash(self, vllm_hash: Hashable) -> int | None:
        """The shoal hash of a block vLLM caches under ``vllm_hash``, or None if none is known."""
        return self._shoal.get(vllm_hash)

    def vllm_key(self, shoal_hash: int) -> Any:
        """vLLM's own key (``BlockHash``) of the cached block ``shoal_hash`` names, or None."""
        vllm_hash = self._vllm.get(shoal_hash)
        return None if vllm_hash is None else self._key.get(vllm_hash)

    def hashes(self) -> list[int]:
        """Every shoal hash vLLM caches now (as far as the events folded so far say)."""
        return list(self._shoal.values())

    # ------------------------------------------------------------------ events

    def fold(self, events: Iterable[Any]) -> None:
        """Apply vLLM's KV cache events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), by
        their class names (this module imports no vLLM); other events are skipped."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                for vllm_hash in event.block_hashes:
                    self._removed(vllm_hash, evicted=True)
            elif kind == "AllBlocksCleared":
                self._shoal.clear()
                self._vllm.clear()
                self._key.clear()
                self._count.clear()
                self._delta.cleared()

    def _stored(self, event: Any) -> None:
        size = self.block_size
        vllm_hashes = list(event.block_hashes)
        tokens = list(event.token_ids)
        whole = event.block_size == size and len(tokens) == len(vllm_hashes) * size
        if not whole or event.group_idx not in (0, None):
            self._unmapped(len(vllm_hashes), f"{len(tokens)} tokens of blocks of {event.block_size}")
            return
        if event.parent_block_hash is None:
            parent = self._root
        else:
            known = self._shoal.get(event.parent_block_hash)
            if known is None:
                self._unmapped(len(vllm_hashes), "its parent block is not known")
                return
            parent = known
        shoal_hashes = extend_block_hashes([], tokens, size, parent)
        keys = self._keys(event.parent_block_hash, vllm_hashes, tokens)
        for vllm_hash, shoal_hash, key in zip(vllm_hashes, shoal_hashes, keys, strict=True):
            count = self._count.get(vllm_hash, 0)
            self._count[vllm_hash] = count + 1
            if count:
                continue
            self._shoal[vllm_hash] = shoal_hash
            self._vllm[shoal_hash] = vllm_hash
            if key is not None:
                self._key[vllm_hash] = key
            self._delta.stored(shoal_hash)

    def _keys(self, parent: Hashable | None, vllm_hashes: list[Hashable], tokens: list[int]) -> list[Any]:
        """vLLM's key of each stored block, None from the first one the hasher does not reproduce."""
        keys: list[Any] = [None] * len(vllm_hashes)
        if self._hasher is None:
            return keys
        key = None if parent is None else self._key.get(parent)
        if parent is not None and key is None:
            return keys
        size = self.block_size
        for index, vllm_hash in enumerate(vllm_hashes):
            key, named = self._hasher(key, tokens[index * size : (index + 1) * size])
            if named != vllm_hash:
                return keys
            keys[index] = key
        return keys

    def _unmapped(self, num_blocks: int, why: str) -> None:
        if not self.num_unmapped:
            log.warning("vllm engine: %d cached block(s) left out of the cache events: %s", num_blocks, why)
        self.num_unmapped += num_blocks

    def _removed(self, vllm_hash: Hashable, *, evicted: bool) -> None:
        count = self._count.get(vllm_hash)
        if count is None:
            return
        if evicted:
            self.num_evictions += 1
        if count > 1:
            self._count[vllm_hash] = count - 1
            return
        del self._count[vllm_hash]
        shoal_hash = self._shoal.pop(vllm_hash)
        self._key.pop(vllm_hash, None)
        if self._vllm.get(shoal_hash) == vllm_hash:
            del self._vllm[shoal_hash]
        self._delta.removed(shoal_hash)

    def take_delta(self) -> CacheDelta:
        """What the cache gained and lost since the last call (net, each hash once)."""
        return self._delta.take()

    # ------------------------------------------------------------- re-sync

    def reconcile(self, present: Iterable[Hashable]) -> int:
        """Drop the blocks vLLM no longer caches: ``present`` are the vLLM hashes its block pool
        holds now (as its events name them). Returns how many were dropped (0 unless events were
        missed or paired wrongly)."""
        held = set(present)
        gone = [vllm_hash for vllm_hash in self._count if vllm_hash not in held]
        for vllm_hash in gone:
            self._count[vllm_hash] = 1
            self._removed(vllm_hash, evicted=False)
        if gone:
            log.warning("vllm engine: %d cached block(s) dropped without a removal event", len(gone))
        return len(gone)
