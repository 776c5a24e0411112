"""``shoal bench bus`` runs end to end and writes the promised JSON (numbers are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_bus_writes_throughputs_and_ratios(nats_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bus.json"
    command = [
        sys.executable,
        "-c",
        "from frontend.cli import main; main()",
        "bench",
        "bus",
        "--nats",
        nats_url,
        "--count",
        "300",
        "--repeat",
        "1",
        "--json",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(out.read_text())
    for key in (
        "append_eps",
        "raw_append_eps",
        "replay_eps",
        "raw_replay_eps",
        "append_ratio",
        "replay_ratio",
    ):
        assert result[key] > 0
    assert result["parameters"]["count"] == 300
    assert "replay" in completed.stdout
