"""The paged KV pool: one tensor holding every block, and whole-block export/import.

Layout (block-major): ``pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
— index 0 of the third axis is K (after rotary embedding), 1 is V. A block is
one contiguous run of ``bytes_per_block`` bytes, so exporting a request's
blocks is one ``index_select`` over the first axis into a contiguous buffer
and importing is one ``index_copy_``; attention reads a layer's keys through
the strided view ``pool[:, layer, 0]`` indexed by block tables.

**KV buffer format, version 1** (what ``export`` produces, ``import_`` takes and
the transport moves as raw bytes): a C-contiguous array of shape
``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` in the pool's dtype,
native (little-endian) byte order, one block after another in the order of
the block list given to ``export``. Block ``i`` is bytes
``[i * bytes_per_block, (i + 1) * bytes_per_block)``; token slot ``s`` of a
block holds the KV of the request's token at position ``block_index *
block_size + s``. Two pools can exchange buffers when their ``KVLayout``
(layers, kv heads, head dim, block size, dtype) is equal.

No scheduling lives here: which blocks a request owns is the local scheduler's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agents.engines.torch_engine.config import ModelConfig, dtype_size

__all__ = [
    "KV_BUFFER_FORMAT_VERSION",
    "KVPoolShape",
    "PagedKVPool",
    "buffer_from_bytes",
    "buffer_to_bytes",
    "dtype_name",
    "torch_dtype",
]

KV_BUFFER_FORMAT_VERSION = 1

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVPoolShape:
    """The geometry of one block; equal shapes can exchange KV buffers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def for_model(cls, config: ModelConfig, *, block_size: int, dtype: str) -> KVPoolShape:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def block_dims(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        layers, kv, size, heads, dim = self.block_dims
        return layers * kv * size * heads * dim * dtype_size(self.dtype)

    def num_blocks_for_budget(self, num_bytes: int) -> int:
        """How many blocks fit in a memory budget of ``num_bytes``."""
        return num_bytes // self.bytes_per_block


class PagedKVPool:
    """``num_blocks`` KV blocks in one tensor, with per-layer views for attention."""

    def __init__(
        self,
        shape: KVPoolShape,
        num_blocks: int,
        *,
        device: torch.device | str = "cpu",
        tensor: Tensor | None = None,
    ) -> None:
        """``tensor``: an existing pool tensor (one in shared memory, say) instead of a new one."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.dtype = torch_dtype(shape.dtype)
        if tensor is not None:
            if tuple(tensor.shape) != (num_blocks, *shape.block_dims) or tensor.dtype != self.dtype:
                raise ValueError(
                    f"a pool tensor of {tuple(tensor.shape)} {tensor.dtype} is not {num_blocks} "
                    f"blocks of {shape}"
                )
            self.device = tensor.device
            self.pool = tensor
        else:
            self.device = torch.device(device)
            self.pool = torch.zeros((num_blocks, *shape.block_dims), dtype=self.dtype, device=self.device)
        #: One row per block: the 2-D view whole-block gathers and scatters go through (the fast path).
        self.rows = self.pool.view(num_blocks, -1)
        #: keys[layer] / values[layer]: strided views [num_blocks, block_size, num_kv_heads, head_dim].
        self.keys = [self.pool[:, layer, 0] for layer in range(shape.num_layers)]
        self.values = [self.pool[:, layer, 1] for layer in range(shape.num_layers)]

    @classmethod
    def from_tensor(cls, shape: KVPoolShape, tensor: Tensor) -> PagedKVPool:
        """A pool over an existing tensor (one both the agent and its engine core process map)."""
        return cls(shape, tensor.shape[0], tensor=tensor)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_block

    def _index(self, block_ids: Sequence[int] | Tensor) -> Tensor:
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        if index.ndim != 1:
            raise ValueError("block ids must be a flat sequence")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in 0..{self.num_blocks - 1}")
        return index

    def export(self, block_ids: Sequence[int] | Tensor, *, out: Tensor | None = None) -> Tensor:
        """Gather blocks into one contiguous buffer (format v1) with a single ``index_select``."""
        index = self._index(block_ids)
        if out is None:
            return self.rows.index_select(0, index).view(-1, *self.shape.block_dims)
        torch.index_select(self.rows, 0, index, out=out.view(index.numel(), -1))
        return out

    def import_(self, block_ids: Sequence[int] | Tensor, buffer: Tensor) -> None:
        """Scatter a format-v1 buffer into blocks with a single ``index_copy_``."""
        index = self._index(block_ids)
        expected = (index.numel(), *self.shape.block_dims)
        if tuple(buffer.shape) != expected or buffer.dtype != self.dtype:
            raise ValueError(
                f"buffer of shape {tuple(buffer.shape)} {buffer.dtype} does not fit "
                f"{expected} {self.dtype}"
            )
        if len(set(index.tolist())) != index.numel():
            raise ValueError("block ids of an import must be distinct")
        source = buffer.to(self.device, non_blocking=True).reshape(index.numel(), -1)
        self.rows.index_copy_(0, index, source)

    def buffer_from_bytes(self, data: bytes | bytearray | memoryview) -> Tensor:
        return buffer_from_bytes(data, self.shape)


def buffer_to_bytes(buffer: Tensor) -> memoryview:
    """The raw bytes of a format-v1 buffer; zero-copy for a contiguous CPU tensor."""
    if buffer.device.type != "cpu":
        buffer = buffer.cpu()
    flat = buffer.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def buffer_from_bytes(data: bytes | bytearray | memoryview, shape: KVPoolShape) -> Tensor:
    """A CPU tensor over ``data`` (no copy) shaped as a format-v1 buffer. Treat it as read-only."""
    view = memoryview(data).cast("B")
    num_bytes = view.nbytes
    if num_bytes % shape.bytes_per_block:
        raise ValueError(f"{num_bytes} bytes is not a whole number of {shape.bytes_per_block}-byte blocks")
    if num_bytes == 0:
        return torch.empty((0, *shape.block_dims), dtype=torch_dtype(shape.dtype))
    with warnings.catch_warnings():
        # frombuffer warns about read-only memory (bytes); the tensor is only ever read.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8)
    return raw.view(torch_dtype(shape.dtype)).view(num_bytes // shape.bytes_per_block, *shape.block_dims)
