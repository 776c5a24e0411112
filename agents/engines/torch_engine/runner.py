"""Runs the model over one step's work: splits it into forward passes and returns next-token logits.

The input is plain data, one ``SequenceWork`` per scheduled sequence (its new
tokens, their first position, its block table); the output is one float32
logits row per sequence, taken at its last new token. Two modes:

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

from collections.abc import Sequence
from dataclasses import dataclass

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

__all__ = ["ModelRunner", "SequenceWork"]


@dataclass(frozen=True, slots=True)
class SequenceWork:
    """Compute KV for ``token_ids`` at positions ``start..`` (stored through ``block_ids``)."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


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

    @torch.inference_mode()
    def logits(self, work: Sequence[SequenceWork]) -> Tensor:
        """Float32 logits [len(work), vocab]: row i predicts the token after ``work[i]``'s last new token."""
        for item in work:
            if not item.token_ids:
                raise ValueError("a scheduled sequence has no new tokens")
        if not work:
            return torch.empty((0, self.model.config.vocab_size))
        passes = self._single_token_passes(work) if self.batch_invariant else self._packed_passes(work)
        rows: list[Tensor | None] = [None] * len(work)
        for pieces in passes:
            last = self._run_pass(work, pieces)
            for piece, row in zip(pieces, last, strict=True):
                if piece.end == len(work[piece.sequence].token_ids):
                    rows[piece.sequence] = row
        return torch.stack([row for row in rows if row is not None])

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

    def _run_pass(self, work: Sequence[SequenceWork], pieces: Sequence[_Piece]) -> Tensor:
        """One forward over ``pieces``; returns the hidden-state logits of each piece's last token."""
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
        return model.logits(hidden[torch.tensor(last_rows, device=device)])
