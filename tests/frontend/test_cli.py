"""The ``shoal`` command lists its subcommands and says clearly what is not built yet."""

from __future__ import annotations

import subprocess
import sys


def _shoal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", *args],
        capture_output=True, text=True, timeout=60,
    )


def test_help_lists_every_subcommand() -> None:
    result = _shoal("--help")
    assert result.returncode == 0
    for name in ("up", "agent", "scheduler", "replay", "simulate", "bench", "events"):
        assert name in result.stdout
