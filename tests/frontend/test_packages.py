"""shoal refuses to start when one of its top-level package names belongs to another distribution."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from frontend.packages import MARKER, PACKAGES, check_packages


def test_every_package_carries_the_marker_and_the_check_passes() -> None:
    root = Path(__file__).resolve().parents[2]
    for name in PACKAGES:
        assert MARKER in (root / name / "__init__.py").read_text()
    check_packages()


def _shadow_agents(where: Path) -> None:
    """A foreign top-level ``agents`` package, installed by a distribution called ``agents-sdk-lookalike``."""
    (where / "agents").mkdir(parents=True)
    (where / "agents" / "__init__.py").write_text('"""Somebody else\'s agents SDK."""\n')
    info = where / "agents_sdk_lookalike-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agents-sdk-lookalike\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("agents\n")
    (info / "RECORD").write_text("agents/__init__.py,,\n")


def test_a_shadowed_package_stops_shoal_with_the_distribution_named(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    _shadow_agents(shadow)
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    run = subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", "agent", "--help"],
        cwd=tmp_path,  # not the checkout: its own packages must not come first on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "'agents'" in run.stderr
    assert "agents-sdk-lookalike" in run.stderr
    assert str(shadow / "agents") in run.stderr
    assert "Traceback" not in run.stderr
