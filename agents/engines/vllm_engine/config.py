"""``VllmEngineConfig``: what a vllm engine instance is built from (no vLLM import here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VllmEngineConfig"]


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """vLLM's usual knobs, passed through to its ``EngineArgs``.

    ``model`` is a local checkpoint folder (nothing is downloaded). KV capacity:
    ``num_blocks`` (vLLM's ``num_gpu_blocks_override``) and/or
    ``kv_cache_bytes`` (``kv_cache_memory_bytes``; on CPU the KV space, which
    vLLM otherwise takes from ``VLLM_CPU_KVCACHE_SPACE``); without either, vLLM
    sizes it from ``gpu_memory_utilization`` (GPU) or its CPU default.
    ``block_size``: vLLM's CPU attention wants a multiple of 32.
    ``migration`` turns prefix caching off (migrated requests get their blocks
    handed over, unhashed) and needs one in-process worker (``tensor_parallel_size`` 1).
    """

    model: str
    block_size: int = 32
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    max_batch_size: int = 256  # vLLM's max_num_seqs
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = True
    migration: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if self.migration and self.tensor_parallel_size != 1:
            raise ValueError(
                "migration with the vllm engine needs tensor_parallel_size 1 (one in-process worker)"
            )
