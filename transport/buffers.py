"""Views of payloads and landing slots as raw bytes, without copying where possible.

A payload (``bytes``, ``bytearray``, ``memoryview``, numpy array, torch tensor
of any dtype) is seen as one flat ``uint8`` buffer: host memory as a
``memoryview`` (a CPU tensor through ``tensor.view(torch.uint8).numpy()``,
which shares its storage — bf16/fp16 tensors included), CUDA memory as a flat
``uint8`` CUDA tensor that UCX can read and write directly. Transports that
only move host bytes (TCP, in-process) stage CUDA tensors through host memory.

torch is never imported here: a tensor is recognised by its type's module, so
the data plane costs nothing to import for callers that only move bytes.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Landing",
    "checksum_of",
    "device_readable",
    "host_readable",
    "is_device_tensor",
    "is_tensor",
    "payload_nbytes",
]


def is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def is_device_tensor(obj: object) -> bool:
    """A torch tensor whose memory is not on the host (CUDA)."""
    return is_tensor(obj) and obj.device.type != "cpu"  # type: ignore[attr-defined]


def _flat_uint8_tensor(tensor: Any) -> Any:
    """The tensor's bytes as a flat uint8 tensor sharing its memory (copies only if not contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def payload_nbytes(payload: object) -> int:
    if is_tensor(payload):
        return int(payload.numel() * payload.element_size())  # type: ignore[attr-defined]
    return memoryview(payload).nbytes  # type: ignore[arg-type]


def host_readable(payload: object) -> memoryview:
    """The payload's bytes as a flat read-only-or-writable ``memoryview`` of host memory.

    Zero-copy for bytes-likes, contiguous numpy arrays and contiguous CPU tensors; a CUDA
    tensor is copied to the host (transports without device support).
    """
    if is_tensor(payload):
        flat = _flat_uint8_tensor(payload)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return memoryview(flat.numpy())
    view = memoryview(payload)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def device_readable(payload: object) -> Any:
    """A CUDA tensor payload as a flat uint8 CUDA tensor (UCX sends it device-to-device)."""
    return _flat_uint8_tensor(payload)


def checksum_of(view: memoryview) -> int:
    return zlib.crc32(view) & 0xFFFFFFFF


@dataclass(frozen=True)
class Landing:
    """Where an accepted buffer's bytes land, and what its waiter receives.

    Exactly one of ``host`` (writable host bytes) and ``device`` (flat uint8 CUDA tensor)
    is set. ``result`` is the caller's ``into`` object, or the ``bytearray`` allocated
    for it.
    """

    result: Any
    nbytes: int
    host: memoryview | None
    device: Any | None

    @classmethod
    def open(cls, into: object | None, nbytes: int) -> Landing:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if into is None:
            allocated = bytearray(nbytes)
            return cls(result=allocated, nbytes=nbytes, host=memoryview(allocated), device=None)
        size = payload_nbytes(into)
        if size != nbytes:
            raise ValueError(f"'into' holds {size} bytes, the transfer has {nbytes}")
        if is_tensor(into) and not into.is_contiguous():  # type: ignore[attr-defined]
            raise ValueError("'into' must be contiguous (a copy would not reach it)")
        if is_device_tensor(into):
            return cls(result=into, nbytes=nbytes, host=None, device=_flat_uint8_tensor(into))
        view = host_readable(into) if is_tensor(into) else memoryview(into)  # type: ignore[arg-type]
        if view.readonly:
            raise ValueError("'into' must be writable")
        if not view.c_contiguous:
            raise ValueError("'into' must be C-contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return cls(result=into, nbytes=nbytes, host=view, device=None)

    def host_target(self) -> tuple[memoryview, Callable[[], None]]:
        """Writable host bytes for a host-only transport, and what to call once they are written.

        For a CUDA landing this is a staging buffer that ``finish`` copies to the device.
        """
        if self.host is not None:
            return self.host, _nothing
        staging = bytearray(self.nbytes)
        device: Any = self.device

        def finish() -> None:
            import torch

            if self.nbytes:
                device.copy_(torch.frombuffer(staging, dtype=torch.uint8))

        return memoryview(staging), finish


def _nothing() -> None:
    return None
