"""NATS subject syntax: validation and wildcard matching, as pure functions.

A subject is dot-separated non-empty tokens without whitespace. In a pattern
``*`` matches exactly one token and ``>`` (last token only) matches one or
more. KV keys follow the JetStream key-value rules. The in-memory bus matches
with these; the JetStream adapter leaves matching to the server and only
validates names before they leave the process.
"""

from __future__ import annotations

import re

from bus.errors import InvalidName

__all__ = ["subject_matches", "validate_key", "validate_key_pattern", "validate_subject"]

_KEY_RE = re.compile(r"[-/_=.a-zA-Z0-9]+")
_KEY_PATTERN_RE = re.compile(r"[-/_=.a-zA-Z0-9*>]+")
_BAD_CHARS = frozenset(" \t\r\n\f\v")
#: A valid subject without wildcards, in one regex match (every token published goes through here).
_PLAIN_SUBJECT_RE = re.compile(r"[^ \t\r\n\f\v.*>]+(?:\.[^ \t\r\n\f\v.*>]+)*")


def validate_subject(subject: str, *, wildcards: bool = False) -> str:
    """Return ``subject`` or raise :class:`InvalidName`; wildcards only if allowed."""
    if _PLAIN_SUBJECT_RE.fullmatch(subject) is not None:
        return subject
    return _validate_tokens(subject, wildcards=wildcards)


def _validate_tokens(subject: str, *, wildcards: bool) -> str:
    """:func:`validate_subject` token by token (a subject with wildcards, or an invalid one)."""
    if not subject:
        raise InvalidName("empty subject")
    tokens = subject.split(".")
    for index, token in enumerate(tokens):
        if not token or any(c in _BAD_CHARS for c in token):
            raise InvalidName(f"invalid subject {subject!r}")
        if token in ("*", ">"):
            if not wildcards:
                raise InvalidName(f"wildcards not allowed here: {subject!r}")
            if token == ">" and index != len(tokens) - 1:
                raise InvalidName(f"'>' must be the last token: {subject!r}")
        elif "*" in token or ">" in token:
            raise InvalidName(f"wildcard inside a token: {subject!r}")
    return subject


def validate_key(key: str) -> str:
    """Return ``key`` or raise :class:`InvalidName` (JetStream KV key rules)."""
    if not _KEY_RE.fullmatch(key) or key.startswith(".") or key.endswith(".") or ".." in key:
        raise InvalidName(f"invalid KV key {key!r}")
    return key


def validate_key_pattern(pattern: str) -> str:
    """Return a KV watch pattern (a key with ``*``/``>`` tokens) or raise :class:`InvalidName`."""
    if not _KEY_PATTERN_RE.fullmatch(pattern):
        raise InvalidName(f"invalid KV key pattern {pattern!r}")
    validate_subject(pattern, wildcards=True)
    return pattern


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a concrete ``subject`` matches ``pattern`` under NATS wildcard rules."""
    if pattern == subject:
        return True
    pattern_tokens = pattern.split(".")
    subject_tokens = subject.split(".")
    for index, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > index
        if index >= len(subject_tokens):
            return False
        if token != "*" and token != subject_tokens[index]:
            return False
    return len(pattern_tokens) == len(subject_tokens)
