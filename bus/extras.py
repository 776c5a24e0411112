"""Optional dependencies: which extra installs a module, and a clear error when one is missing.

The base install (``pip install shoal``) runs the scheduler, the frontend, the
``sim`` engine, replay, events, the simulator and the drills. The rest comes
with extras:

=========  ==========================================================================
extra      what it adds
=========  ==========================================================================
torch      the torch engine (torch, safetensors); ``./install.sh`` installs it
bench      plots (matplotlib) and ``shoal bench serve``'s client (aiohttp)
vllm       the vllm engine (``./install.sh --vllm`` on a machine without a GPU)
ucx        the UCX transport (transport kind ``auto`` falls back to TCP without it)
dev        the test and lint tools, and every extra above but vllm
=========  ==========================================================================

Asking for something whose extra is missing (``--engine torch``, a plot) is a
:class:`MissingExtra`: a usage error (exit status 2) that names the extra, not
a traceback.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import click

__all__ = ["ENGINE_MODULES", "EXTRAS", "Extra", "MissingExtra", "missing_extra", "require", "require_engine"]


@dataclass(frozen=True)
class Extra:
    """The extra that installs a module: its name, what needs the module, how to install it."""

    name: str
    needed_by: str
    install: str


_TORCH = "pip install 'shoal[torch]' or ./install.sh"
_BENCH = "pip install 'shoal[bench]' or ./install.sh"

#: Top-level module -> the extra that installs it.
EXTRAS: dict[str, Extra] = {
    "torch": Extra("torch", "the torch engine", _TORCH),
    "safetensors": Extra("torch", "loading a checkpoint into the torch engine", _TORCH),
    "matplotlib": Extra("bench", "drawing plots", _BENCH),
    "aiohttp": Extra("bench", "shoal bench serve's client", _BENCH),
    "vllm": Extra(
        "vllm", "the vllm engine",
        "./install.sh --vllm, or pip install 'shoal[vllm]' with an NVIDIA GPU",
    ),
    "transformers": Extra(
        "dev", "writing a Hugging Face checkpoint", "pip install 'shoal[dev]' or ./install.sh --dev"
    ),
    "ucxx": Extra("ucx", "the UCX transport", "pip install 'shoal[ucx]'"),
}

#: Engine name -> the module it cannot run without (``sim`` needs none).
ENGINE_MODULES: dict[str, str] = {"torch": "torch", "vllm": "vllm"}


class MissingExtra(click.ClickException):
    """A module of an extra that is not installed; exit status 2 on the command line."""

    exit_code = 2

    def __init__(self, module: str, needed_by: str | None = None) -> None:
        extra = EXTRAS[module]
        self.module = module
        self.extra = extra
        super().__init__(f"{needed_by or extra.needed_by} needs {module}, which is not installed "
                         f"(the '{extra.name}' extra): {extra.install}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a half-removed module
        return False


def require(module: str, needed_by: str | None = None) -> None:
    """Nothing if ``module`` (a key of :data:`EXTRAS`) can be imported, else :class:`MissingExtra`.

    Looks the module up without importing it (torch takes seconds to import).
    """
    if not _installed(module):
        raise MissingExtra(module, needed_by)


def require_engine(engine: str) -> None:
    """:class:`MissingExtra` if engine ``engine`` needs a module that is not installed."""
    module = ENGINE_MODULES.get(engine)
    if module is not None:
        require(module, f"the {engine} engine")


def missing_extra(error: BaseException) -> MissingExtra | None:
    """The :class:`MissingExtra` behind ``error``, if a module of an extra is what failed to import.

    Follows ``raise ... from`` and exception groups, so an import that fails
    deep inside a task is still explained.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, MissingExtra):
            return current
        if isinstance(current, ModuleNotFoundError) and current.name:
            root = current.name.partition(".")[0]
            if root in EXTRAS:
                return MissingExtra(root)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        if current.__cause__ is not None:  # not __context__: an import tried and handled earlier
            pending.append(current.__cause__)
    return None
