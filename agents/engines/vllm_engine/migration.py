"""The migration half of :class:`~.engine.VllmEngine`: reservations, block export/import, admission.

Reservations are blocks taken from vLLM's own block pool (so vLLM's free
count, and shoal's stats, see them as used); stages are written into them
through :class:`~.kv_blocks.KVBlocks` over the KV tensors of the engine's
in-process worker. Admission hands the request to vLLM's waiting queue and the
reserved blocks to the request (:meth:`MigrationSupport._hand_over`): no copy,
and no free blocks beyond the reservation. Suspend/resume live in
:class:`~.scheduler.ShoalScheduler`. One in-process worker only (the engine
reads the worker's KV tensors in this process; tensor parallelism would need
``collective_rpc``).

With prefix caching on, a request's table may hold blocks it shares with other requests:
export only reads them, and the source's release (vLLM's ``finish_requests``) drops only
this request's references. A reservation is fresh blocks (``get_new_blocks`` evicts a cached
block nobody uses before handing it out), so an import never writes a block the cache holds;
vLLM caches the imported full blocks itself when it first schedules the admitted request.
A destination lends an incoming migration the blocks its cache holds of the request's
chain (:meth:`MigrationSupport.hold_cached_blocks`: vLLM's ``touch``, one reference each);
admission puts them first in the request's table, checked against the request's own vLLM
block hashes, and marks them cached for vLLM (``num_cached_block``) so they are not stored
again.

Buffer format: layer-major, per layer of vLLM's KV tensors (in the worker's
order) that layer's slices of the blocks, raw bytes (``bytes_per_block`` per
block in all); see :mod:`.kv_blocks`.
"""

from __future__ import annotations

import itertools
import warnings
from collections import Counter
from collections.abc import Container, Sequence
from typing import Any, Protocol

from agents.engines.block_manager import OutOfBlocks, Reservation
from agents.engines.protocol import EngineInfo, KVBuffer, MigrationError, UnknownRequest
from agents.engines.vllm_engine.kv_blocks import KVBlocks
from agents.engines.vllm_engine.prefix_cache import VllmCacheIndex
from schemas import SamplingParams

__all__ = ["MigrationSupport"]


class EngineInternals(Protocol):
    """What migration uses of :class:`~.engine.VllmEngine` (its vLLM scheduler and core, its bookkeeping)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def scheduler(self) -> Any: ...

    @property
    def core(self) -> Any: ...

    @property
    def _requests(self) -> Container[str]: ...

    @property
    def _cache(self) -> VllmCacheIndex | None: ...

    def _block_ids(self, request_id: str) -> tuple[int, ...]: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool: ...


class MigrationSupport:
    """Reservations and block copies of one vllm engine; see the module docstring."""

    def __init__(self, engine: EngineInternals) -> None:
        self.engine = engine
        self.pool = engine.scheduler.kv_cache_manager.block_pool
        self.reservations: dict[int, list[Any]] = {}  # reservation id -> vLLM KVCacheBlocks
        self._reserved_ids: set[int] = set()
        #: cached blocks lent to incoming migrations: block id -> references taken
        self._held: Counter[int] = Counter()
        self._ids = itertools.count(1)
        self._kv: KVBlocks | None = None

    @property
    def num_reserved_blocks(self) -> int:
        return len(self._reserved_ids)

    @property
    def kv(self) -> KVBlocks:
        if self._kv is None:
            runner = self.engine.core.model_executor.driver_worker.worker.model_runner
            self._kv = KVBlocks(runner.kv_caches, self.pool.num_gpu_blocks)
            if self._kv.bytes_per_block != self.engine.info.bytes_per_block:
                raise MigrationError(
                    f"vLLM's KV tensors hold {self._kv.bytes_per_block} bytes per block, "
                    f"expected {self.engine.info.bytes_per_block}"
                )
        return self._kv

    # --------------------------------------------------------- source side

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer:
        if request_id not in self.engine._requests:
            raise UnknownRequest(request_id)
        table = self.engine._block_ids(request_id)
        bad = [i for i in block_indices if not 0 <= i < len(table)]
        if bad:
            raise MigrationError(f"request {request_id!r} holds {len(table)} blocks; cannot export {bad[:5]}")
        data = self.kv.gather([table[i] for i in block_indices])
        payload = data.numpy().data.cast("B")  # zero-copy: gather's result is flat and contiguous
        return KVBuffer(len(block_indices), payload.nbytes, payload)

    # ---------------------------------------------------- destination side

    def reserve(self, num_blocks: int) -> Reservation:
        free = self.pool.get_num_free_blocks()
        if num_blocks > free:
            raise OutOfBlocks(num_blocks, free)
        blocks = self.pool.get_new_blocks(num_blocks)
        reservation = Reservation(next(self._ids), tuple(b.block_id for b in blocks))
        self.reservations[reservation.reservation_id] = blocks
        self._reserved_ids.update(reservation.block_ids)
        return reservation

    def release_reservation(self, reservation: Reservation) -> int:
        blocks = self.reservations.pop(reservation.reservation_id, None)
        if blocks is None:
            return 0
        self.pool.free_blocks(blocks)
        self._reserved_ids.difference_update(reservation.block_ids)
        return len(blocks)

    def hold_cached_blocks(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        index = self.engine._cache
        if index is None:
            return ()
        index.fold(self.engine.scheduler.take_kv_events())
        blocks: list[Any] = []
        for block_hash in block_hashes:
            key = index.vllm_key(block_hash)
            found = None if key is None else self.pool.get_cached_block(key, [0])
            if not found:
                break
            blocks.append(found[0])
        self.pool.touch(blocks)
        self._held.update(b.block_id for b in blocks)
        return tuple(b.block_id for b in blocks)

    def drop_held_blocks(self, block_ids: Sequence[int]) -> None:
        blocks = []
        for block_id in block_ids:
            if self._held[block_id] > 0:
                self._held[block_id] -= 1
                blocks.append(self.pool.blocks[block_id])
        self._held += Counter()  # drop the zero counts
        self.pool.free_blocks(reversed(blocks))  # the chain's tail is evicted first

    def _check_cached(self, request_id: str, tokens: Sequence[int], block_ids: Sequence[int]) -> None:
        """MigrationError unless each block is lent here and cached under vLLM's key of the
        request's block at its place."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_block_hash, hash_block_tokens

        size = self.engine.info.block_size
        if len(block_ids) * size > len(tokens) or Counter(block_ids) - self._held:
            raise MigrationError(f"blocks {list(block_ids)[:5]} are not lent cached blocks of {request_id!r}")
        config = self.engine.core.vllm_config.cache_config
        hash_fn = get_hash_fn_by_name(config.prefix_caching_hash_algo)
        key = None
        for index, block_id in enumerate(block_ids):
            key = hash_block_tokens(hash_fn, key, tokens[index * size : (index + 1) * size])
            cached = self.pool.blocks[block_id].block_hash
            if cached is None or get_block_hash(cached) != key:
                raise MigrationError(
                    f"block {index} of request {request_id!r} (local block {block_id}) is not a "
                    "cached block of its prefix"
                )

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        import torch

        bytes_per_block = self.engine.info.bytes_per_block
        if buffer.num_blocks != len(block_ids):
            raise MigrationError(f"buffer holds {buffer.num_blocks} blocks, {len(block_ids)} block ids given")
        if (
            buffer.nbytes != buffer.num_blocks * bytes_per_block
            or memoryview(buffer.payload).nbytes != buffer.nbytes
        ):
            raise MigrationError(
                f"buffer of {buffer.nbytes} bytes for {buffer.num_blocks} blocks of {bytes_per_block} bytes: "
                "KV layouts differ or it carries no KV data"
            )
        not_reserved = [b for b in block_ids if b not in self._reserved_ids]
        if not_reserved:
            raise MigrationError(f"blocks {not_reserved[:5]} are not reserved; reserve before importing")
        if not block_ids:
            return
        with warnings.catch_warnings():
            # frombuffer warns about read-only memory (bytes); the tensor is only read by the scatter
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(memoryview(buffer.payload).cast("B"), dtype=torch.uint8)
        self.kv.scatter(list(block_ids), raw)

    def admit_migrated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
        reservations: Sequence[Reservation],
        *,
        num_computed_tokens: int | None = None,
        cached_block_ids: Sequence[int] = (),
    ) -> None:
        engine = self.engine
        tokens = (*prompt_token_ids, *output_token_ids)
        computed = len(tokens) - 1 if num_computed_tokens is None else num_computed_tokens
        cached = tuple(cached_block_ids)
        blocks = cached + tuple(b for r in reservations for b in r.block_ids)
        missing = [r.reservation_id for r in reservations if r.reservation_id not in self.reservations]
        if missing:
            raise MigrationError(f"reservations {missing} are not held here")
        if -(-computed // engine.info.block_size) > len(blocks):
            raise MigrationError(f"{computed} computed tokens need more than the {len(blocks)} blocks given")
        if not 0 < computed < len(tokens):
            raise MigrationError(
                f"{computed} computed tokens of {len(tokens)}: one token must be left to compute"
            )
        groups = len(engine.scheduler.kv_cache_manager.coordinator.single_type_managers)
        if groups != 1:  # hybrid / sliding-window models keep several block tables per request
            raise MigrationError(f"this model has {groups} KV cache groups; migration handles one")
        if cached:
            self._check_cached(request_id, tokens, cached)
        if not engine.add_request(
            request_id, prompt_token_ids, sampling, priority, output_token_ids=output_token_ids
        ):
            raise MigrationError(f"request {request_id!r} already lives here")
        self._hand_over(request_id, computed, reservations, cached)

    def _hand_over(
        self, request_id: str, computed: int, reservations: Sequence[Reservation], cached: Sequence[int] = ()
    ) -> None:
        """Make the reserved blocks the waiting request's own, its first ``computed`` tokens computed.

        This is the state vLLM itself leaves a request in once an asynchronous
        KV load finished (``WAITING`` with blocks and ``num_computed_tokens``):
        its scheduler then skips the cache lookup and allocates only the
        blocks still missing. No copy, and admission needs no second set of
        free blocks. Reserved blocks beyond the computed tokens go back to the pool. Lent cached
        blocks (``cached``) come first, their references the request's; vLLM counts them as the
        request's cached blocks, so it stores only the blocks after them.
        The request waits in the queue vLLM drains first (requests holding blocks),
        ahead of requests that have none yet.
        """
        engine = self.engine
        request = engine.scheduler.requests[request_id]
        manager = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        held = [block for r in reservations for block in self.reservations.pop(r.reservation_id)]
        for reservation in reservations:
            self._reserved_ids.difference_update(reservation.block_ids)
        lent = [self.pool.blocks[block_id] for block_id in cached]
        self._held -= Counter(cached)
        needed = max(-(-computed // engine.info.block_size) - len(lent), 0)
        manager.req_to_blocks[request_id].extend([*lent, *held[:needed]])
        if lent:
            manager.num_cached_block[request_id] = len(lent)
        if held[needed:]:
            self.pool.free_blocks(held[needed:])
        request.num_computed_tokens = computed
        # vLLM schedules waiting requests that hold KV blocks (async loads) before the waiting
        # queue, whose FCFS scan stops at a head it cannot admit: the migrated request goes there,
        # so it continues at the next step (as in Llumnix) rather than behind queued requests.
        scheduler = engine.scheduler
        scheduler.waiting.remove_request(request)
        holding = getattr(scheduler, "kv_holding_waiting", None)  # in vLLM 0.32; older: the queue head
        if holding is not None:
            holding.add_request(request)
        else:
            scheduler.waiting.prepend_request(request)
