"""The start-up check that shoal's top-level packages are shoal's own.

shoal's packages have plain names (``agents``, ``bus``, ``frontend``,
``scheduler``, ``schemas``, ``transport``) that other distributions use too —
an agents SDK installs a top-level ``agents``. With an editable install a
same-named package elsewhere on ``sys.path`` silently wins, and shoal would
fail later in a way that names neither. Each of shoal's package ``__init__``
carries a marker line; :func:`check_packages` finds each package without
importing it, reads its ``__init__`` for the marker, and otherwise raises
:class:`ForeignPackage` naming the distribution that owns the impostor.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

__all__ = ["MARKER", "PACKAGES", "ForeignPackage", "check_packages"]

PACKAGES = ("agents", "bus", "frontend", "scheduler", "schemas", "transport")
MARKER = "__shoal_package__ = True"


class ForeignPackage(RuntimeError):
    """A top-level package shoal needs resolves to another distribution's package."""


def _owners(name: str) -> list[str]:
    try:
        return sorted(set(importlib.metadata.packages_distributions().get(name, [])) - {"shoal"})
    except Exception:  # broken metadata elsewhere must not hide the real problem
        return []


def _problem(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        return f"cannot be located: {exc}"
    if spec is None:
        return "is not installed"
    origin = spec.origin
    if origin is None or not origin.endswith("__init__.py"):
        where = ", ".join(spec.submodule_search_locations or []) or "?"
        return f"resolves to a namespace package or module at {where}, not shoal's package"
    try:
        text = Path(origin).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"cannot be read at {origin}: {exc}"
    if MARKER not in text:
        return f"resolves to {Path(origin).parent}, which is not shoal's package"
    return None


def check_packages(names: tuple[str, ...] = PACKAGES) -> None:
    """Raise :class:`ForeignPackage` if any of ``names`` is not shoal's own package."""
    problems = []
    for name in names:
        problem = _problem(name)
        if problem is None:
            continue
        owners = _owners(name)
        owned = f" (installed by the distribution {', '.join(repr(o) for o in owners)})" if owners else ""
        problems.append(f"top-level package {name!r} {problem}{owned}")
    if problems:
        raise ForeignPackage(
            "shoal's packages are shadowed: "
            + "; ".join(problems)
            + ". Uninstall the other distribution or run shoal in its own virtualenv (./install.sh)."
        )
