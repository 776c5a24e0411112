"""Process helpers shared by the tests that start ``shoal`` subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["alive"]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
