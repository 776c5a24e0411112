"""``shoal bench tracing`` end to end at a tiny size: a throughput ratio, and spans a receiver really took.

Two shoals (scheduler, one torch agent of the ``tiny`` preset, frontend) off
and on, one round of two streams of eight tokens; the numbers are not
asserted, but that the traced side exported every part of the trace and the
untraced side nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# ~10 s on 2 idle cores; its nine CPU-bound children (two shoals of four processes, an OTLP
# receiver) share the cores, so a loaded runner takes several times that. The limit only catches
# a hang (speed is the bench's to measure, never asserted); the suite's own limit is 300 s.
pytestmark = [pytest.mark.slow]


def test_bench_tracing_reports_a_ratio_and_the_spans_its_receiver_took(tmp_path: Path) -> None:
    out = tmp_path / "tracing.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    completed = subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", "bench", "tracing",
         "--preset", "tiny", "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "8",
         "--rounds", "1", "--export-delay-ms", "100", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False, env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert not list(scratch.glob("shoal-bench-tracing-*"))  # its logs' folder is gone with it
    result = json.loads(out.read_text())["results"]["2"]
    assert result["ratio"] > 0 and result["off_tps"] > 0 and result["on_tps"] > 0
    assert result["off_tokens"] == result["on_tokens"] == 2 * 8
    assert result["spans_received"] > 0 and result["spans_received_during_off"] == 0
    # the frontend's server span, the scheduler's dispatch and the agent's generate tree, per request
    per_request = {"POST /v1/completions", "dispatch", "generate", "queue", "prefill", "decode"}
    assert per_request <= set(result["spans_by_name"]), result["spans_by_name"]
    assert result["spans_by_name"]["POST /v1/completions"] == 4  # two warm-ups and two streams
    assert "ratio" in completed.stdout
