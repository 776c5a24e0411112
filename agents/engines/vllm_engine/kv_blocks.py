"""``KVBlocks``: one engine's KV tensors seen as blocks — gather and scatter (torch only).

vLLM allocates one KV tensor per attention layer; its layout depends on the
attention backend (CPU: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``;
flash-attention: ``[2, num_blocks, ...]``), so the block dimension is found
by its size. A gathered buffer is layer-major: per layer (in order), that
layer's slices of the blocks in the order given, raw bytes; so each layer is
one contiguous run written by one ``index_select`` and read by one
``index_copy_``, with no copy in between.
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
        """The blocks as one flat CPU ``uint8`` tensor of ``len(block_ids) * bytes_per_block`` bytes."""
        count = len(block_ids)
        out = torch.empty(count * self.bytes_per_block, dtype=torch.uint8)
        offset = 0
        for tensor, dim in zip(self.tensors, self.dims, strict=True):
            shape = [count, *tensor.shape[:dim], *tensor.shape[dim + 1 :]]
            width = count * tensor.element_size() * int(torch.Size(shape[1:]).numel())
            target = out[offset : offset + width].view(tensor.dtype).view(shape)
            offset += width
            index = self._index(tensor, block_ids)
            if dim == 0 and tensor.device.type == "cpu":
                torch.index_select(tensor, 0, index, out=target)
            else:
                target.copy_(tensor.index_select(dim, index).movedim(dim, 0))
        return out

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write a :meth:`gather` result (flat ``uint8``) into ``block_ids``."""
        count = len(block_ids)
        offset = 0
        for tensor, dim in zip(self.tensors, self.dims, strict=True):
            shape = [count, *tensor.shape[:dim], *tensor.shape[dim + 1 :]]
            width = count * tensor.element_size() * int(torch.Size(shape[1:]).numel())
            chunk = data[offset : offset + width].to(tensor.device)
            offset += width
            values = chunk.view(tensor.dtype).view(shape).movedim(0, dim)
            tensor.index_copy_(dim, self._index(tensor, block_ids), values)
