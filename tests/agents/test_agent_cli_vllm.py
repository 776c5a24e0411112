"""``shoal agent --engine vllm`` alone, as a user runs it: vLLM's block size, 1 GiB of KV and CPU binding.

Without ``--kv-cache-bytes`` (and without ``VLLM_CPU_KVCACHE_SPACE``) vLLM on
CPU would give each process 90% of the RAM for KV; the agent gives it 1 GiB,
as ``shoal up`` does, and says so in its log. Skipped where vLLM is not
installed, or not the CPU build.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason, vllm_version
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from agents.engines.vllm_engine.cpu_binding import physical_cores, plan_cpu_binding
from schemas import InstanceJoined, InstanceLeft
from tests.agents.agent_cluster import agent_cluster

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.skipif(
        not (vllm_version() or "").endswith("+cpu"), reason="the 1 GiB default is for CPU vLLM"
    ),
]


async def test_shoal_agent_vllm_alone_gets_one_gib_of_kv_on_cpu(nats_url: str, tmp_path: Path) -> None:
    checkpoint = build_checkpoint(tmp_path / "llama")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from frontend.cli import main; main()", "agent",
            "--engine", "vllm", "--model", str(checkpoint), "--max-model-len", "512",
            "--nats", nats_url, "--prefix", cluster.subjects.prefix, "--instance-id", "v1",
            "--transport", "tcp", "--ready-file", str(ready), "--log-level", "INFO",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            async with asyncio.timeout(180):
                while not ready.exists() and process.returncode is None:
                    await asyncio.sleep(0.1)
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 60)
        log = output.decode(errors="replace")
        assert ready.exists(), log[-3000:]
        assert process.returncode == 0, log[-3000:]
        assert "vllm on CPU: 1 GiB of KV space" in log
        # vLLM's CPU binding, done in-process: the model thread on all allowed CPUs but the last
        allowed = sorted(os.sched_getaffinity(0))
        binding = plan_cpu_binding(allowed, env, None, physical_cores(allowed))
        assert binding.describe() in log
        if binding.cpus:
            cpus = list(binding.cpus)
            assert f"model thread pinned to CPUs {cpus} with {len(cpus)} torch thread(s)" in log
        events = [env.body for _, env in await cluster.stored(cluster.subjects.instance("v1"))]
        joined = events[0]
        assert isinstance(joined, InstanceJoined) and joined.engine == "vllm"
        assert joined.block_size == 32  # vLLM's CPU attention wants multiples of 32 (torch's default is 16)
        layout = joined.kv_layout  # K and V of every layer, kv head and token of a block
        element = {"float32": 4, "bfloat16": 2, "float16": 2}[layout.dtype]
        bytes_per_block = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 32 * element
        assert 0.98 * 2**30 <= (joined.num_blocks + 1) * bytes_per_block <= 2**30  # + vLLM's null block
        assert isinstance(events[-1], InstanceLeft)
