"""What a vllm engine is built from, checked without vLLM: KV space defaults, refused options, the CLI.

These run where vLLM is not installed: the config and the ``shoal agent``
option checks import no vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from agents.cli import agent
from agents.engines.vllm_engine.config import CPU_KV_CACHE_BYTES, VllmEngineConfig, default_kv_cache_bytes


def test_cpu_vllm_gets_one_gib_of_kv_unless_told_otherwise() -> None:
    assert CPU_KV_CACHE_BYTES == 2**30
    assert default_kv_cache_bytes(None, "0.32.0+cpu", {}) == 2**30
    assert default_kv_cache_bytes(123, "0.32.0+cpu", {}) == 123  # --kv-cache-bytes wins
    assert (
        default_kv_cache_bytes(None, "0.32.0+cpu", {"VLLM_CPU_KVCACHE_SPACE": "4"}) is None
    )  # vLLM reads it
    assert default_kv_cache_bytes(None, "0.32.0", {}) is None  # GPU: gpu_memory_utilization sizes it


def test_tensor_parallelism_with_migration_is_refused_clearly() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 2: live migration .* needs tensor_parallel_size 1"
    ):
        VllmEngineConfig(model="m", tensor_parallel_size=2)
    assert VllmEngineConfig(model="m", tensor_parallel_size=2, migration=False).tensor_parallel_size == 2


def test_shoal_agent_refuses_tensor_parallelism_before_starting_anything(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        agent, ["--engine", "vllm", "--model", str(tmp_path), "--tensor-parallel-size", "2"]
    )
    assert result.exit_code == 2, result.output
    assert "needs tensor_parallel_size 1" in result.output and "Traceback" not in result.output
