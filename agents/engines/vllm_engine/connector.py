"""``ShoalMigrationConnector``: the vLLM KV connector that lands migrated KV in a request's blocks.

Registered through vLLM's public seam ``KVTransferConfig(kv_connector=...,
kv_connector_module_path=..., kv_role="kv_both")``; vLLM builds one instance
per role in the engine process (scheduler side) and one per worker.

Migrated blocks arrive before their request exists in vLLM: shoal reserves
free blocks from vLLM's block pool and writes the stages into them. At commit
the request enters vLLM's waiting queue like any other and vLLM asks this
connector how many of its tokens are already computed elsewhere
(``get_num_new_matched_tokens``): all but the last. vLLM allocates the
request's own blocks (``update_state_after_alloc``), and the step's connector
metadata (:class:`BlockCopies`) lists the reserved blocks to copy into them
before the forward pass; the engine then frees the reservation.

Who copies: the engine, between ``schedule()`` and the model execution, on the
KV tensors it reads from its in-process worker. The worker-side hooks
(``start_load_kv``) would be the place with out-of-process workers, but vLLM
keeps the worker-side connector in a process-wide singleton
(``get_kv_transfer_group``), so two engines in one process (shoal's tests,
``bench_fleet``) would share it; the worker side here is therefore a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

__all__ = ["BlockCopies", "PendingImport", "ShoalMigrationConnector"]


@dataclass
class BlockCopies(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's copies: (reserved block, the request's block) pairs, and whose they are."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


@dataclass
class PendingImport:
    """A migrated request waiting for vLLM to allocate its blocks."""

    num_computed_tokens: int
    source_block_ids: tuple[int, ...]


class ShoalMigrationConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """See the module docstring. The engine talks to the scheduler-side instance directly."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        self.pending: dict[str, PendingImport] = {}
        self._copies = BlockCopies()
        self.loaded: list[str] = []  # request ids whose copies went out in a step's metadata

    # ---------------------------------------------------------- scheduler

    def expect(self, request_id: str, num_computed_tokens: int, source_block_ids: tuple[int, ...]) -> None:
        """A migrated request is about to be added; its KV sits in ``source_block_ids``."""
        self.pending[request_id] = PendingImport(num_computed_tokens, source_block_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        pending = self.pending.get(request.request_id)
        if pending is None:
            return 0, False
        return max(0, pending.num_computed_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pending = self.pending.pop(request.request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        destination = blocks.get_block_ids()[0]
        block_size = self._vllm_config.cache_config.block_size
        num_blocks = -(-pending.num_computed_tokens // block_size)
        self._copies.copies.extend(zip(pending.source_block_ids[:num_blocks], destination, strict=False))
        self._copies.request_ids.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._copies = self._copies, BlockCopies()
        self.loaded.extend(meta.request_ids)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.pending.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        return None  # the engine copies blocks itself (see the module docstring)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
