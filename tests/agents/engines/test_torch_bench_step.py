"""``shoal bench step`` runs on the tiny preset beside a baseline checkout and compares greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from frontend.cli import cli

_AGENTS = Path(__file__).resolve().parents[3] / "agents"


def _checkout(tmp_path: Path, *, broken: bool) -> Path:
    """A copy of this checkout's ``agents`` package; ``broken``: its sampler picks the least likely token."""
    root = tmp_path / "baseline"
    shutil.copytree(_AGENTS, root / "agents", ignore=shutil.ignore_patterns("__pycache__"))
    if broken:
        sampling = root / "agents" / "engines" / "torch_engine" / "sampling.py"
        text = sampling.read_text()
        assert "chosen = processed.argmax(-1)" in text
        sampling.write_text(text.replace("chosen = processed.argmax(-1)", "chosen = processed.argmin(-1)"))
    return root


def _run(baseline: Path, results: Path) -> Result:
    arguments = [
        "bench", "step", "--model", "tiny", "--baseline", str(baseline), "--prompts", "2",
        "--prompt-len", "24", "--decodes", "2", "--repeats", "1", "--rounds", "1", "--json", str(results),
    ]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(cli, arguments)
    finally:
        torch.set_num_threads(threads)  # --threads sets the process-wide count


@pytest.mark.parametrize("broken", [False, True])
def test_bench_step_measures_both_engines_and_says_whether_their_tokens_agree(
    tmp_path: Path, broken: bool
) -> None:
    results = tmp_path / "step.json"
    outcome = _run(_checkout(tmp_path, broken=broken), results)
    assert outcome.exit_code == 0, outcome.output
    data = json.loads(results.read_text())
    assert data["tokens_identical"] == {"default": not broken}
    assert sorted(data["results"]) == ["baseline/default", "now/default"]
    for row in data["results"].values():
        assert row["prefill_us_per_token"] > 0 and row["decode_step_ms"] > 0 and row["burst_steps"] >= 1
    assert ("DIFFERENT from" in outcome.output) == broken
