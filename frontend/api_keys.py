"""API keys of the HTTP frontend: reading them, and checking one in constant time.

Keys come from ``--api-key`` (repeatable; env ``SHOAL_API_KEY``, several
separated by whitespace) and ``--api-key-file`` (one key per line, ``#``
comments; env ``SHOAL_API_KEY_FILE``), read at the entry point. A presented
key is compared with every configured key by :func:`hmac.compare_digest`,
so neither which key matched nor how much of one matched shows in the time
the check takes. Keys never appear in logs, errors or the config's ``repr``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

__all__ = ["key_matches", "read_key_file"]


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in ``path``: one per line, blank lines and ``#`` comments skipped."""
    keys = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keys.append(stripped)
    if not keys:
        raise ValueError(f"no API key in {path}")
    return tuple(keys)


def key_matches(presented: str, keys: Iterable[str]) -> bool:
    """Whether ``presented`` is one of ``keys``; every key is compared, each in constant time."""
    candidate = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key.encode())
    return found
