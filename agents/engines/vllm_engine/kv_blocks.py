"""``KVBlocks``: one engine's KV tensors seen as blocks — gather and scatter (torch only).

vLLM allocates one KV tensor per attention layer; its layout depends on the
attention backend (CPU: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``;
flash-attention: ``[2, num_blocks, ...]``), so the block dimension is found
by its size. A gathered buffer is block-major: per block, every layer's slice
in layer order, raw bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVBlocks"]


class KVBlocks:
    """Block-level access to a list of per-layer KV tensors that have ``num_blocks`` blocks each."""

    def __init__(self, tensors: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.tensors = list(tensors)
        self.dims: list[int] = []
        for index, tensor in enumerate(self.tensors):
            dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
            if len(dims) != 1:
                raise RuntimeError(
                    f"cannot find the block dimension of KV tensor {index} {tuple(tensor.shape)} "
                    f"({num_blocks} blocks)"
                )
            self.dims.append(dims[0])
        self.bytes_per_block = sum(t.element_size() * t.numel() // num_blocks for t in self.tensors)

    def _index(self, tensor: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=tensor.device)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks as one CPU ``uint8`` tensor of shape ``[len(block_ids), bytes_per_block]``."""
        parts = []
        for tensor, dim in zip(self.tensors, self.dims, strict=True):
            blocks = tensor.index_select(dim, self._index(tensor, block_ids)).movedim(dim, 0).contiguous()
            parts.append(blocks.view(torch.uint8).reshape(len(block_ids), -1))
        return torch.cat(parts, dim=1).cpu()

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write a :meth:`gather` result into ``block_ids``."""
        offset = 0
        for tensor, dim in zip(self.tensors, self.dims, strict=True):
            shape = [len(block_ids), *tensor.shape[:dim], *tensor.shape[dim + 1 :]]
            width = tensor.element_size() * int(torch.Size(shape[1:]).numel())
            chunk = data[:, offset : offset + width].to(tensor.device).contiguous()
            offset += width
            values = chunk.view(tensor.dtype).reshape(shape).movedim(0, dim)
            tensor.index_copy_(dim, self._index(tensor, block_ids), values)
