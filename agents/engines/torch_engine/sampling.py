"""Next-token sampling: grammar mask, logit bias, penalties, greedy, temperature, min-p, top-k, top-p.

vLLM's order: the structured-output grammar's mask (-inf outside the allowed ids), then the
processors that can change the greedy choice (min_tokens' banned ids, ``logit_bias`` added to
the logits), then the penalties; greedy rows take the argmax there; random rows then divide by
the temperature, drop what ``min_p`` drops (probability below ``min_p`` times the most likely
token's) and apply top-k and top-p. Logprobs are those of the raw model distribution (vLLM's
default ``raw_logprobs``), whatever the mask and processors did.

Randomness is counter-based: the noise for a request's ``i``-th generated
token comes from a generator seeded with ``mix(seed, i)``, so no generator
state moves with a migrated request and a request's tokens do not depend on
what else is in the batch. A request without a seed gets one derived from
its id (stable across instances, so a rescued or migrated request continues
the same random stream). Sampling draws ``argmax(p / E)`` with ``E`` i.i.d.
Exp(1) noise (the exponential race, equivalent to sampling from ``p``).

Stop rules (max_tokens, EOS, stop ids, ignore_eos) are the local scheduler's;
here ``min_tokens`` only masks the tokens that would stop the request early.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from agents.engines.grammar import GrammarCompiler, GrammarMatcher
from schemas import Alternatives, SamplingParams

__all__ = [
    "SampleResult",
    "SamplingRow",
    "check_sampling_params",
    "noise_seed",
    "refused_mask",
    "request_seed",
    "sample",
    "unpack_refused",
    "wants_history",
    "with_grammar_masks",
]

#: Temperatures below this are greedy (as in vLLM).
GREEDY_EPSILON = 1e-5
_MASK64 = (1 << 64) - 1


def request_seed(request_id: str, seed: int | None) -> int:
    """The request's seed: its own, or one derived from its id when it has none."""
    if seed is not None:
        return seed & _MASK64
    return int.from_bytes(hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest(), "little")


def noise_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for the ``index``-th token of a request seeded ``seed`` (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def check_sampling_params(sampling: SamplingParams) -> str | None:
    """What is wrong with ``sampling`` for this engine's sampler, or None."""
    if not sampling.temperature >= 0.0:
        return f"temperature must be >= 0, got {sampling.temperature}"
    if not 0.0 < sampling.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {sampling.top_p}"
    if sampling.top_k == 0 or sampling.top_k < -1:
        return f"top_k must be -1 (off) or >= 1, got {sampling.top_k}"
    if not sampling.repetition_penalty > 0.0:
        return f"repetition_penalty must be > 0, got {sampling.repetition_penalty}"
    if not 0 <= sampling.top_logprobs <= 20:
        return f"top_logprobs must be in [0, 20], got {sampling.top_logprobs}"
    if not 0.0 <= sampling.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {sampling.min_p}"
    for token_id, bias in sampling.logit_bias:
        if not -100.0 <= bias <= 100.0:
            return f"logit_bias of token {token_id} must be in [-100, 100], got {bias}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -2.0 <= value <= 2.0:
            return f"{name} must be in [-2, 2], got {value}"
    return None


def wants_history(params: SamplingParams) -> bool:
    """Whether sampling ``params`` reads the request's tokens so far (a penalty does)."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """How to pick the next token of one request."""

    params: SamplingParams
    seed: int  # see request_seed
    output_index: int  # index of the token being sampled among the request's generated tokens
    history: Sequence[int] = ()  # prompt + generated tokens, for the penalties (see wants_history)
    banned_token_ids: Sequence[int] = ()  # EOS and stop ids while fewer than min_tokens are out
    #: the grammar's allowed ids (``agents.engines.grammar`` bitmask: bit i % 32 of int32 word
    #: i // 32); None: no constraint
    allowed: NDArray[np.int32] | None = None


def with_grammar_masks(
    rows: list[SamplingRow], constraints: Sequence[object | None], grammars: GrammarCompiler
) -> list[SamplingRow]:
    """``rows`` with the next position's mask of each one whose request has a grammar
    (``constraints[i]``: row ``i``'s request's constraint, a :class:`GrammarMatcher`, or None);
    the masks of a step are computed together."""
    picked = [i for i, constraint in enumerate(constraints) if isinstance(constraint, GrammarMatcher)]
    if not picked:
        return rows
    masks = grammars.fill_bitmasks([c for c in constraints if isinstance(c, GrammarMatcher)])
    rows = list(rows)
    for mask, i in zip(masks, picked, strict=True):
        rows[i] = dataclasses.replace(rows[i], allowed=mask)
    return rows


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    #: log-probability of each chosen token under the raw model distribution, for the rows whose
    #: params ask for it (``SamplingParams.logprobs``); None for the others, empty if none asks
    logprobs: list[float | None]
    #: the most likely (token id, logprob) pairs of the rows that ask (``top_logprobs``), as ``logprobs``
    top: list[Alternatives | None] = field(default_factory=list)


def refused_mask(bitmasks: Sequence[NDArray[np.int32]], vocab_size: int, device: torch.device) -> Tensor:
    """Bool [len(bitmasks), vocab_size] on ``device``: the ids each bitmask does not allow (ids past
    a mask: none). On CPU numpy unpacks the bits; elsewhere the int32 words cross (32 ids per word)
    and are unpacked there."""
    words = np.stack(bitmasks)
    if device.type == "cpu":
        bits = np.unpackbits(np.invert(words).view(np.uint8), axis=-1, bitorder="little")
        refused = torch.from_numpy(bits.view(np.bool_))
    else:
        refused = unpack_refused(torch.from_numpy(words).to(device))
    if refused.shape[1] < vocab_size:
        return torch.nn.functional.pad(refused, (0, vocab_size - refused.shape[1]), value=True)
    return refused[:, :vocab_size]


def unpack_refused(words: Tensor) -> Tensor:
    """Bool [rows, 32 x words]: the clear bits of int32 bitmask ``words`` [rows, words]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 1).eq(0).flatten(1)


def _apply_grammar_and_processors(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """The grammar's mask, then min_tokens' banned ids and the logit bias (vLLM's processors that
    can change the greedy choice). A grammar that allows only banned ids wins over min_tokens (the
    local scheduler stops a complete grammar anyway)."""
    masks = [row.allowed for row in rows if row.allowed is not None]
    if masks:
        refused = refused_mask(masks, logits.shape[-1], logits.device)
        if len(masks) == len(rows):
            logits.masked_fill_(refused, float("-inf"))
        else:
            constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
            rows_index = torch.tensor(constrained, device=logits.device)
            logits[rows_index] = logits[rows_index].masked_fill(refused, float("-inf"))
    for index, row in enumerate(rows):
        if row.banned_token_ids:
            banned = torch.tensor(list(row.banned_token_ids), dtype=torch.int64, device=logits.device)
            kept = logits[index, banned].clone() if row.allowed is not None else None
            logits[index, banned] = float("-inf")
            if kept is not None and bool(torch.isneginf(logits[index]).all()):
                logits[index, banned] = kept
        if row.params.logit_bias:
            ids, biases = zip(*row.params.logit_bias, strict=True)
            logits[index, torch.tensor(ids, dtype=torch.int64, device=logits.device)] += torch.tensor(
                biases, dtype=logits.dtype, device=logits.device
            )


def _apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """vLLM's order: repetition (prompt and output tokens), then frequency and presence (output only)."""
    for index, row in enumerate(rows):
        params = row.params
        penalty = params.repetition_penalty
        if penalty != 1.0 and row.history:
            seen = torch.tensor(sorted(set(row.history)), dtype=torch.int64, device=logits.device)
            values = logits[index, seen]
            logits[index, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (params.frequency_penalty or params.presence_penalty) and row.output_index and row.history:
            output = torch.tensor(row.history[-row.output_index:], dtype=torch.int64, device=logits.device)
            counts = torch.bincount(output, minlength=logits.shape[-1]).to(logits.dtype)
            logits[index] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """vLLM's min-p: drop (to -inf) each row's ids whose probability is below ``min_p`` times the
    row's highest; returns new logits."""
    probs = logits.softmax(-1)
    threshold = min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _truncate(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus; returns new logits."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    outside = rank >= top_k[:, None]
    probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability mass strictly above each token
    outside |= (before > top_p[:, None]) & (rank > 0)
    masked = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def sample(logits: Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
    """Pick one token per row of ``logits`` [B, vocab] (float32; not modified)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    if not rows:
        return SampleResult([], [])
    processed = logits.clone()
    _apply_grammar_and_processors(processed, rows)
    _apply_penalties(processed, rows)
    chosen = processed.argmax(-1)
    random_rows = [i for i, row in enumerate(rows) if row.params.temperature >= GREEDY_EPSILON
                   and row.params.top_k != 1]
    if random_rows:
        device = logits.device
        vocab = logits.shape[-1]
        index = torch.tensor(random_rows, device=device)
        picked = [rows[i].params for i in random_rows]
        temperature = torch.tensor([p.temperature for p in picked], device=device)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in picked], device=device)
        top_p = torch.tensor([p.top_p for p in picked], device=device)
        scaled = processed[index] / temperature[:, None]
        if any(p.min_p > 0.0 for p in picked):
            scaled = _apply_min_p(scaled, torch.tensor([p.min_p for p in picked], device=device))
        needs_truncation = any(p.top_k > 0 or p.top_p < 1.0 for p in picked)
        if needs_truncation:
            scaled = _truncate(scaled, top_k, top_p)
        probs = scaled.softmax(-1)
        noise = torch.stack([
            torch.empty(vocab).exponential_(generator=torch.Generator().manual_seed(
                noise_seed(rows[i].seed, rows[i].output_index)))
            for i in random_rows
        ]).to(device)
        chosen[index] = (probs / noise).argmax(-1)
    token_ids = chosen.tolist()
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
    if not wanted:
        return SampleResult(token_ids, [])
    # a log-softmax over the vocabulary only for the rows that ask
    index = torch.tensor(wanted, device=logits.device)
    raw = logits[index].log_softmax(-1)
    values = raw.gather(-1, chosen[index][:, None])[:, 0].tolist()
    logprobs: list[float | None] = [None] * len(rows)
    top: list[Alternatives | None] = [None] * len(rows)
    for position, (i, value) in enumerate(zip(wanted, values, strict=True)):
        logprobs[i] = value
        k = min(rows[i].params.top_logprobs, raw.shape[-1])
        if k > 0:
            best = raw[position].topk(k)
            top[i] = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return SampleResult(token_ids, logprobs, top if any(t is not None for t in top) else [])
