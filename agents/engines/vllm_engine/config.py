"""``VllmEngineConfig``: what a vllm engine instance is built from (no vLLM import here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CPU_KV_CACHE_BYTES", "DEFAULT_BLOCK_SIZE", "VllmEngineConfig", "default_kv_cache_bytes"]

#: vLLM's CPU attention wants a block size that is a multiple of 32 (the torch engine's default is 16).
DEFAULT_BLOCK_SIZE = 32

#: KV space per vLLM engine on CPU when none is given: vLLM's own CPU default is 90% of the RAM per
#: process, so two agents on one machine would not start.
CPU_KV_CACHE_BYTES = 2**30


def default_kv_cache_bytes(
    kv_cache_bytes: int | None, vllm_version: str | None, environ: Mapping[str, str]
) -> int | None:
    """The KV space to give a vllm engine: the one asked for, else :data:`CPU_KV_CACHE_BYTES` on CPU.

    None leaves the choice to vLLM: on a GPU (``gpu_memory_utilization``), or
    on CPU when ``VLLM_CPU_KVCACHE_SPACE`` (GiB, read by vLLM) is set.
    """
    if kv_cache_bytes is not None or environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return kv_cache_bytes
    if (vllm_version or "").endswith("+cpu"):
        return CPU_KV_CACHE_BYTES
    return None


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """vLLM's usual knobs, passed through to its ``EngineArgs``.

    ``model`` is a local checkpoint folder (nothing is downloaded). KV capacity:
    ``num_blocks`` (vLLM's ``num_gpu_blocks_override``) and/or
    ``kv_cache_bytes`` (``kv_cache_memory_bytes``; on CPU the KV space, which
    vLLM otherwise takes from ``VLLM_CPU_KVCACHE_SPACE``); without either, vLLM
    sizes it from ``gpu_memory_utilization`` (GPU) or its CPU default.
    ``block_size``: vLLM's CPU attention wants a multiple of 32.
    ``prefix_cache``: vLLM's automatic prefix caching (``enable_prefix_caching``), with
    its KV cache events turned into shoal's block hashes (:mod:`.prefix_cache`).
    ``migration`` needs one in-process worker (``tensor_parallel_size`` 1:
    anything else is refused with a ValueError).
    ``cpus``: the CPUs the model thread is pinned to, with one torch (OpenMP)
    thread each (see :mod:`.cpu_binding`; ``shoal agent`` picks them as vLLM's
    CPU worker would); empty leaves the thread unpinned and torch's thread
    count as it is.
    """

    model: str
    block_size: int = DEFAULT_BLOCK_SIZE
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
    prefix_cache: bool = True
    cpus: tuple[int, ...] = ()
    #: ``step_async(exclusive=True)`` waits for a step with the caller's loop blocked only when it
    #: should take at most this long (the last step's time, scaled by tokens); a longer one (a long
    #: prompt's chunk on CPU) is awaited, so the agent keeps answering RPCs meanwhile
    inline_step_max_s: float = 0.05

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if self.inline_step_max_s < 0:
            raise ValueError("inline_step_max_s must be >= 0")
        if any(cpu < 0 for cpu in self.cpus):
            raise ValueError(f"cpus {self.cpus}: CPU ids are >= 0")
        if self.migration and self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size}: live migration with the vllm engine "
                "needs tensor_parallel_size 1 (shoal reads and writes the KV blocks of one in-process "
                "worker; tensor parallelism would need vLLM's collective_rpc for export, import and "
                "hand-over, not built)"
            )
