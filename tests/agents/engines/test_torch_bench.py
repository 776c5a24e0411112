"""``shoal bench engine`` runs end to end on the tiny preset; writes its JSON and a profile ``sim`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner, Result

from agents.engines.profile import load_profile
from agents.engines.sim import SimEngine
from frontend.cli import cli


def _run_bench(results: Path, profile_path: Path) -> Result:
    arguments = [
        "bench", "engine", "--presets", "tiny", "--batch-sizes", "1,4", "--context-len", "40",
        "--prompt-len", "32", "--steps", "2", "--kv-preset", "tiny", "--kv-pool-blocks", "16",
        "--kv-blocks", "4", "--repeats", "2", "--threads", "1", "--json", str(results),
        "--profile-out", str(profile_path), "--profile-preset", "tiny",
    ]
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(cli, arguments)
    finally:
        torch.set_num_threads(threads)  # --threads sets the process-wide count


def test_bench_engine_writes_results_and_a_sim_profile(tmp_path: Path) -> None:
    results, profile_path = tmp_path / "engine.json", tmp_path / "profile.json"
    outcome = _run_bench(results, profile_path)
    assert outcome.exit_code == 0, outcome.output
    data = json.loads(results.read_text())
    assert data["torch_threads"] == 1
    assert [(row["preset"], row["batch_size"]) for row in data["decode"]] == [("tiny", 1), ("tiny", 4)]
    assert all(row["tokens_per_s"] > 0 for row in data["decode"])
    for key in ("export_gbps", "import_gbps", "plain_copy_gbps"):
        assert data[key] > 0
    profile = load_profile(profile_path)
    assert profile.kv_bytes_per_block == data["kv_transfer"]["bytes_per_block"]
    engine = SimEngine(profile, num_blocks=64)
    assert engine.info.kv_layout.num_layers == 2
    assert "tokens/s" in outcome.output and "GB/s" in outcome.output
