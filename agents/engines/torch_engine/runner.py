"""Runs the model over one step's work: splits it into forward passes and returns next-token logits.

The input is plain data, one ``SequenceWork`` per scheduled sequence (its new
tokens, their first position, its block table); the output is one float32
logits row per sequence, taken at its last new token. A sequence may also ask
for prompt scores (:class:`PromptScoring`, vLLM's prompt logprobs): the
log-softmax over the vocabulary at each of its positions, the logprob of the
token that follows there and the ``k`` most likely tokens. Only those
sequences pay for logits at every position, a few hundred rows at a time. Two modes:

* **fast** (default): one pass for all decodes and as many prefill tokens as
  ``max_pass_tokens`` allows; a longer prompt is chunked over several passes.
  Linear layers see the whole batch, so a sequence's numbers can change in
  the last bits with what else is in the batch.
* **batch-invariant**: every token of every sequence is its own one-token
  pass. A sequence's numbers then depend only on its own tokens — not on the
  batch, the prefill chunking, a migration or a recompute after preemption —
  so equivalence tests can compare token sequences exactly. Slow; for tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from agents.engines.torch_engine.attention import (
    AttentionPlan,
    GatherWorkspace,
    PagedAttention,
    SequenceSlice,
)
from agents.engines.torch_engine.kv_cache import PagedKVPool
from agents.engines.torch_engine.model import LlamaForCausalLM
from schemas import Alternatives

__all__ = ["ModelRunner", "PromptScores", "PromptScoring", "SequenceWork"]

#: Rows of full-vocabulary logits computed at once for prompt scores (bounds their memory).
SCORE_ROWS = 256


@dataclass(frozen=True, slots=True)
class SequenceWork:
    """Compute KV for ``token_ids`` at positions ``start..`` (stored through ``block_ids``)."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Score the first ``len(targets)`` positions of a sequence's new tokens: ``targets[i]`` is
    the token that follows position ``i`` (the next prompt token); ``k`` alternatives each."""

    targets: Sequence[int]
    k: int = 0


@dataclass(slots=True)
class PromptScores:
    """Per scored position: the target's logprob, and the ``k`` most likely (token, logprob) pairs."""

    logprobs: list[float] = field(default_factory=list)
    top: list[Alternatives] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Piece:
    sequence: int
    begin: int  # index into that sequence's token_ids
    end: int


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: PagedKVPool,
        *,
        batch_invariant: bool = False,
        max_pass_tokens: int = 2048,
    ) -> None:
        if max_pass_tokens <= 0:
            raise ValueError("max_pass_tokens must be positive")
        self.model = model
        self.pool = pool
        self.batch_invariant = batch_invariant
        self.max_pass_tokens = max_pass_tokens
        self.workspace = GatherWorkspace(pool)

    def logits(self, work: Sequence[SequenceWork]) -> Tensor:
        """Float32 logits [len(work), vocab]: row i predicts the token after ``work[i]``'s last new token."""
        return self.run(work)[0]

    @torch.inference_mode()
    def run(
        self, work: Sequence[SequenceWork], scoring: Mapping[int, PromptScoring] | None = None
    ) -> tuple[Tensor, dict[int, PromptScores]]:
        """:meth:`logits`, and the prompt scores of the sequences ``scoring`` names (by index in ``work``)."""
        scoring = scoring or {}
        for item in work:
            if not item.token_ids:
                raise ValueError("a scheduled sequence has no new tokens")
        for index, spec in scoring.items():
            if len(spec.targets) > len(work[index].token_ids):
                raise ValueError(f"sequence {index} scores {len(spec.targets)} positions of "
                                 f"{len(work[index].token_ids)}")
        scores = {index: PromptScores() for index in scoring}
        if not work:
            return torch.empty((0, self.model.config.vocab_size)), scores
        passes = self._single_token_passes(work) if self.batch_invariant else self._packed_passes(work)
        rows: list[Tensor | None] = [None] * len(work)
        for pieces in passes:
            last = self._run_pass(work, pieces, scoring, scores)
            for piece, row in zip(pieces, last, strict=True):
                if piece.end == len(work[piece.sequence].token_ids):
                    rows[piece.sequence] = row
        return torch.stack([row for row in rows if row is not None]), scores

    def _packed_passes(self, work: Sequence[SequenceWork]) -> list[list[_Piece]]:
        """Decodes first, then prompts; a prompt overflowing a pass continues in the next ones."""
        budget = self.max_pass_tokens
        passes: list[list[_Piece]] = [[]]
        used = 0
        order = sorted(range(len(work)), key=lambda i: (len(work[i].token_ids) > 1, i))
        for index in order:
            total = len(work[index].token_ids)
            begin = 0
            while begin < total:
                if used >= budget:
                    passes.append([])
                    used = 0
                end = min(total, begin + budget - used)
                passes[-1].append(_Piece(index, begin, end))
                used += end - begin
                begin = end
        return passes

    @staticmethod
    def _single_token_passes(work: Sequence[SequenceWork]) -> list[list[_Piece]]:
        return [
            [_Piece(index, position, position + 1)]
            for index, item in enumerate(work)
            for position in range(len(item.token_ids))
        ]

    def _run_pass(
        self,
        work: Sequence[SequenceWork],
        pieces: Sequence[_Piece],
        scoring: Mapping[int, PromptScoring],
        scores: dict[int, PromptScores],
    ) -> Tensor:
        """One forward over ``pieces``; returns the logits of each piece's last token, and appends
        the prompt scores of the scored positions among them to ``scores``."""
        model = self.model
        device = model.device
        slices: list[SequenceSlice] = []
        token_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for piece in pieces:
            item = work[piece.sequence]
            start = item.start + piece.begin
            slices.append(SequenceSlice(start, piece.end - piece.begin, item.block_ids))
            token_ids.extend(item.token_ids[piece.begin : piece.end])
            positions.extend(range(start, item.start + piece.end))
            last_rows.append(len(token_ids) - 1)
        plan = AttentionPlan.build(slices, block_size=self.pool.block_size, device=device)
        attend = PagedAttention(
            self.pool, plan, sliding_window=model.config.sliding_window, workspace=self.workspace
        )
        hidden = model.hidden_states(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            attend,
        )
        if scoring:
            first_row = 0
            for piece in pieces:
                spec = scoring.get(piece.sequence)
                if spec is not None:
                    end = min(piece.end, len(spec.targets))
                    if end > piece.begin:
                        rows = range(first_row, first_row + end - piece.begin)
                        self._score(hidden, rows, spec.targets[piece.begin : end], spec.k,
                                    scores[piece.sequence])
                first_row += piece.end - piece.begin
        return model.logits(hidden[torch.tensor(last_rows, device=device)])

    def _score(
        self, hidden: Tensor, rows: range, targets: Sequence[int], k: int, out: PromptScores
    ) -> None:
        """Log-softmax over the vocabulary at ``rows`` of ``hidden``: each target's logprob, the top ``k``."""
        device = hidden.device
        k = min(k, self.model.config.vocab_size)
        for begin in range(0, len(rows), SCORE_ROWS):
            chunk = rows[begin : begin + SCORE_ROWS]
            logprobs = self.model.logits(hidden[chunk.start : chunk.stop]).log_softmax(-1)
            wanted = torch.tensor(targets[begin : begin + SCORE_ROWS], dtype=torch.int64, device=device)
            out.logprobs.extend(logprobs.gather(-1, wanted[:, None])[:, 0].tolist())
            if k > 0:
                best = logprobs.topk(k)
                out.top.extend(
                    tuple(zip(ids, values, strict=True))
                    for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True)
                )
            else:
                out.top.extend(() for _ in chunk)
