"""``shoal bench vllm-serve``'s server list and command lines (no vLLM needed; the runs need it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest

from frontend.bench_vllm_serve import EngineOptions, paired_ratios, parse_servers, server_command

OPTIONS = EngineOptions(Path("/ckpt"), max_model_len=1024, block_size=32, kv_cache_bytes=2**30, dtype="auto")


def test_servers_default_pair_and_the_built_in_engine() -> None:
    assert parse_servers("vllm,shoal") == ("vllm", "shoal")
    assert parse_servers(" vllm , shoal-torch,shoal ") == ("vllm", "shoal-torch", "shoal")


@pytest.mark.parametrize("text", ["shoal", "vllm", "vllm,vllm", "vllm,shoal,tgi", ""])
def test_a_list_without_the_baseline_or_with_unknown_names_is_refused(text: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_servers(text)


def test_each_shoal_server_runs_one_agent_of_its_engine_on_the_same_checkpoint(tmp_path: Path) -> None:
    vllm_engine = server_command("shoal", OPTIONS, 8001, tmp_path)
    torch_engine = server_command("shoal-torch", OPTIONS, 8002, tmp_path)
    for command, engine in ((vllm_engine, "vllm"), (torch_engine, "torch")):
        assert command[command.index("--engine") + 1] == engine
        assert command[command.index("--model") + 1] == "/ckpt"
        assert command[command.index("--instances") + 1] == "1"
    assert torch_engine[torch_engine.index("--threads") + 1] == "1"
    assert "--dtype" not in torch_engine  # auto: the engine's own float32 on CPU
    in_float32 = server_command("shoal-torch", dataclasses.replace(OPTIONS, dtype="float32"), 8005, tmp_path)
    assert in_float32[in_float32.index("--dtype") + 1] == "float32"  # the comparison's dtype, as vllm's
    half = server_command("shoal-torch-bf16", OPTIONS, 8004, tmp_path)
    assert half[half.index("--dtype") + 1] == "bfloat16" and half[half.index("--engine") + 1] == "torch"
    assert "/ckpt" in server_command("vllm", OPTIONS, 8000, tmp_path)
    with pytest.raises(ValueError, match="unknown server"):
        server_command("tgi", OPTIONS, 8003, tmp_path)


def test_paired_ratios_compare_each_round_with_vllm_in_the_same_round() -> None:
    # the first repeat ran on a fast machine, the second on one half as fast: both servers alike
    vllm = [
        {"output_tps": 2000.0, "ttft_p50_ms": 50.0, "tpot_p50_ms": 5.0},
        {"output_tps": 1000.0, "ttft_p50_ms": 100.0, "tpot_p50_ms": 10.0},
    ]
    shoal = [
        {"output_tps": 1900.0, "ttft_p50_ms": 55.0, "tpot_p50_ms": 5.0},
        {"output_tps": 950.0, "ttft_p50_ms": 110.0, "tpot_p50_ms": 10.0},
    ]
    paired = paired_ratios(shoal, vllm)
    assert paired["tps_ratios"] == pytest.approx([0.95, 0.95])
    assert paired["median_tps_ratio"] == pytest.approx(0.95)
    assert paired["median_ttft_p50_ratio"] == pytest.approx(1.1)
    assert paired["median_tpot_p50_ratio"] == pytest.approx(1.0)
    # the ratio of the medians would mix the rounds; the paired one does not
    swapped = paired_ratios(shoal[::-1], vllm)
    assert swapped["tps_ratios"] == pytest.approx([0.475, 1.9])
    with pytest.raises(ValueError, match="rounds"):
        paired_ratios(shoal, vllm[:1])
