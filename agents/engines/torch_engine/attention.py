"""Attention that reads K/V through block tables of the paged pool.

One forward pass works on a flat list of new tokens from several sequences.
``AttentionPlan`` says, for that pass, where each new token's K/V goes (block
and slot) and how the sequences attend:

* **decode rows** (one new token each) are batched: their blocks are gathered
  through a padded block-table tensor into ``[B, S, kv_heads, head_dim]``
  (reusable memory, see ``GatherWorkspace``) and attended with a length mask by
  ``scaled_dot_product_attention``, all sequences at once (measured faster on
  CPU than a per-sequence loop, and than a hand-written matmul/softmax), the
  query heads of each KV head as that head's query rows;
* **prefill pieces** (several new tokens of one sequence) attend with
  ``scaled_dot_product_attention`` and a causal mask, over their own fresh
  K/V when the piece starts the sequence, else over the sequence's blocks.

``PagedAttention`` is the model's ``Attend`` callback for one plan. Nothing
here decides what runs (the local scheduler) or how a pass is split (the runner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from agents.engines.torch_engine.kv_cache import PagedKVPool

__all__ = [
    "AttentionPlan",
    "DecodeRows",
    "GatherWorkspace",
    "PagedAttention",
    "PrefillPiece",
    "SequenceSlice",
]


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """``num_new`` new tokens of one sequence at positions ``start..start+num_new-1``, in ``block_ids``."""

    start: int
    num_new: int
    block_ids: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """Sequences that feed one token each, batched."""

    rows: Tensor  # [B] row of each sequence's token in the pass
    block_tables: Tensor  # [B, max_blocks], padded with block 0
    context_lens: Tensor  # [B] tokens each attends to (its own new one included)
    max_context: int


@dataclass(frozen=True, slots=True)
class PrefillPiece:
    """Several new tokens of one sequence: rows ``row..row+num_new-1`` of the pass."""

    row: int
    start: int
    num_new: int
    block_table: Tensor  # [blocks covering start + num_new tokens]


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    slot_blocks: Tensor  # [T] block of each new token
    slot_offsets: Tensor  # [T] slot within that block
    decode: DecodeRows | None
    prefills: tuple[PrefillPiece, ...]
    num_tokens: int

    @classmethod
    def build(
        cls, slices: Sequence[SequenceSlice], *, block_size: int, device: torch.device
    ) -> AttentionPlan:
        """The plan for a pass whose rows are ``slices``' new tokens, one slice after another."""
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillPiece] = []
        row = 0
        for piece in slices:
            num_blocks = -(-piece.context_len // block_size)
            if len(piece.block_ids) < num_blocks:
                raise ValueError(
                    f"{len(piece.block_ids)} blocks cannot hold {piece.context_len} tokens of KV"
                )
            table = piece.block_ids[:num_blocks]
            position = piece.start
            while position < piece.context_len:  # one block's run of slots at a time
                offset = position % block_size
                run = min(block_size - offset, piece.context_len - position)
                slot_blocks.extend([table[position // block_size]] * run)
                slot_offsets.extend(range(offset, offset + run))
                position += run
            if piece.num_new == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(piece.context_len)
            else:
                prefills.append(
                    PrefillPiece(row, piece.start, piece.num_new, torch.tensor(table, device=device))
                )
            row += piece.num_new
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
            decode = DecodeRows(
                rows=torch.tensor(decode_rows, device=device),
                block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
                context_lens=torch.tensor(decode_lens, device=device),
                max_context=max(decode_lens),
            )
        return cls(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64, device=device),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.int64, device=device),
            decode=decode,
            prefills=tuple(prefills),
            num_tokens=row,
        )


class GatherWorkspace:
    """Reusable memory for the blocks a decode pass gathers: steps do not allocate (and page-fault) anew."""

    def __init__(self, pool: PagedKVPool) -> None:
        self._pool = pool
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    def buffers(self, num_blocks: int) -> tuple[Tensor, Tensor]:
        """Two buffers of at least ``num_blocks`` blocks of one layer's K (or V); grown by doubling."""
        if self._keys is None or self._keys.shape[0] < num_blocks:
            pool = self._pool
            size = max(num_blocks, 2 * (0 if self._keys is None else self._keys.shape[0]))
            dims = (size, *pool.keys[0].shape[1:])
            self._keys = torch.empty(dims, dtype=pool.dtype, device=pool.device)
            self._values = torch.empty(dims, dtype=pool.dtype, device=pool.device)
        assert self._values is not None
        return self._keys, self._values


class PagedAttention:
    """The ``Attend`` callback of one pass: write new K/V into the pool, attend through block tables."""

    def __init__(
        self,
        pool: PagedKVPool,
        plan: AttentionPlan,
        *,
        sliding_window: int | None = None,
        workspace: GatherWorkspace | None = None,
    ) -> None:
        self.pool = pool
        self.plan = plan
        self.sliding_window = sliding_window
        self.workspace = workspace

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        plan = self.plan
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[plan.slot_blocks, plan.slot_offsets] = k
        values[plan.slot_blocks, plan.slot_offsets] = v
        num_tokens, num_heads, head_dim = q.shape
        if plan.decode is not None and not plan.prefills:
            return self._decode(q, keys, values, plan.decode).reshape(num_tokens, num_heads * head_dim)
        out = q.new_empty(q.shape)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode(q[plan.decode.rows], keys, values, plan.decode)
        for piece in plan.prefills:
            rows = slice(piece.row, piece.row + piece.num_new)
            if piece.start == 0:
                piece_k, piece_v = k[rows], v[rows]
            else:
                context = piece.start + piece.num_new
                piece_k = self._gather(keys, piece.block_table, None).flatten(0, 1)[:context]
                piece_v = self._gather(values, piece.block_table, None).flatten(0, 1)[:context]
            out[rows] = self._prefill(q[rows], piece_k, piece_v, piece.start)
        return out.reshape(num_tokens, num_heads * head_dim)

    def _gather(self, cache: Tensor, table: Tensor, spare: Tensor | None) -> Tensor:
        """``cache[table]`` for a block table of any shape, into reusable memory when given."""
        flat = table.reshape(-1)
        if spare is None:
            gathered = cache.index_select(0, flat)
        else:
            gathered = torch.index_select(cache, 0, flat, out=spare[: flat.numel()])
        return gathered.view(*table.shape, *cache.shape[1:])

    def _decode(self, q: Tensor, keys: Tensor, values: Tensor, decode: DecodeRows) -> Tensor:
        """Attention of one query per sequence [B, H, D] over its blocks, batched with a length mask."""
        batch, num_heads, head_dim = q.shape
        workspace = self.workspace
        spare_k, spare_v = workspace.buffers(decode.block_tables.numel()) if workspace else (None, None)
        k = self._gather(keys, decode.block_tables, spare_k).flatten(1, 2)  # [B, S, Hkv, D]
        v = self._gather(values, decode.block_tables, spare_v).flatten(1, 2)
        key_pos = torch.arange(k.shape[1], device=q.device)[None, :]
        lens = decode.context_lens[:, None]
        allowed = key_pos < lens
        if self.sliding_window is not None:
            allowed &= key_pos >= lens - self.sliding_window
        # The query heads that share a KV head are that head's query rows ([B, Hkv, group, D]):
        # one pass over each gathered KV head serves its whole group, as one query per head with
        # ``enable_gqa`` does not (faster on CPU, by far the most in bfloat16).
        num_kv_heads = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
            k.transpose(1, 2),  # strided views: SDPA reads them in place
            v.transpose(1, 2),
            attn_mask=allowed[:, None, None, :],
        )
        return out.reshape(batch, num_heads, head_dim)

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Causal attention of ``q`` [n, H, D] at positions start.. over ``k``/``v`` [start+n, Hkv, D]."""
        num_new = q.shape[0]
        context = k.shape[0]
        window = self.sliding_window
        mask: Tensor | None = None
        if start > 0 or (window is not None and context > window):
            query_pos = torch.arange(start, start + num_new, device=q.device)[:, None]
            key_pos = torch.arange(context, device=q.device)[None, :]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= key_pos > query_pos - window
            mask = allowed
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
