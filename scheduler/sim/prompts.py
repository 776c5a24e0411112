"""Prompt token ids of simulated requests: deterministic runs of tokens, equal where prompts share.

A workload names a prompt's parts as *segments* ``(seed, num_tokens)``; a segment's tokens are a
run drawn from its seed alone (:func:`segment_tokens`), so two prompts that name the same
segments in the same order hold the same tokens, and the engines' prefix cache (chained block
hashes over token ids) finds what they share at whatever block size the profile has:

* a Mooncake trace row: one segment per hash id (the seed is the hash id, 512 tokens each),
  the prompt cut to the row's ``input_length`` (:func:`trace_block_segments`);
* a multi-turn session (:mod:`scheduler.sim.sessions`): the previous turn's prompt and answer,
  then the new user message; the first turn starts with its group's system prompt;
* a prompt with no segments, or the part of one its segments do not cover: a run seeded by the
  request id, shared with no other request.

What lives here is arithmetic on token ids; when a request's tokens are built (at its placement)
is the simulator's business.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SESSION_SYSTEM",
    "SESSION_USER",
    "TRACE_BLOCK_TOKENS",
    "prompt_token_ids",
    "segment_seed",
    "segment_tokens",
    "trace_block_segments",
]

#: Tokens per hash id in Mooncake's traces.
TRACE_BLOCK_TOKENS = 512
#: Seed kinds, so the segments of different origins never share a seed.
TRACE_BLOCK, SESSION_SYSTEM, SESSION_USER, UNIQUE = 0, 1, 2, 3
_SEED_BITS = 60
_SEED_MASK = (1 << _SEED_BITS) - 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def segment_seed(kind: int, *parts: int) -> int:
    """A segment's seed from its kind and identifying numbers (a hash id; a group; a session and turn)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) & _SEED_MASK
    return (kind << _SEED_BITS) | value


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def segment_tokens(seed: int, num_tokens: int, vocab_size: int) -> np.ndarray:
    """The first ``num_tokens`` tokens of the run drawn from ``seed``: ids in ``0 .. vocab_size - 1``.

    A shorter run is a prefix of a longer one from the same seed.
    """
    with np.errstate(over="ignore"):
        start = np.uint64(seed & ((1 << 64) - 1)) * _GOLDEN
        counters = np.arange(num_tokens, dtype=np.uint64) + start
        tokens: np.ndarray = _splitmix(counters) % np.uint64(vocab_size)
    return tokens


def trace_block_segments(
    block_ids: Sequence[int], block_tokens: int = TRACE_BLOCK_TOKENS
) -> tuple[tuple[int, int], ...]:
    """The segments of a trace row's prompt: one run of ``block_tokens`` tokens per block id."""
    return tuple((segment_seed(TRACE_BLOCK, block_id & _SEED_MASK), block_tokens) for block_id in block_ids)


def prompt_token_ids(
    request_id: str,
    num_tokens: int,
    segments: Sequence[tuple[int, int]],
    vocab_size: int,
    context: Sequence[int] = (),
) -> list[int]:
    """A prompt of ``num_tokens`` tokens: ``context`` (the previous turn's tokens), then the segments,
    then a run of the request's own for whatever is left, cut to ``num_tokens``."""
    parts: list[np.ndarray] = []
    have = len(context)
    for seed, length in segments:
        if have >= num_tokens:
            break
        take = min(length, num_tokens - have)
        parts.append(segment_tokens(seed, take, vocab_size))
        have += take
    if have < num_tokens:
        own = segment_seed(UNIQUE, zlib.crc32(request_id.encode()), len(request_id))
        parts.append(segment_tokens(own, num_tokens - have, vocab_size))
    tokens = list(context[:num_tokens])
    for part in parts:
        tokens.extend(part.tolist())
    return tokens
