"""AMX tile permission for an in-process vLLM worker on an x86 CPU with AMX.

Linux lets a process use Intel AMX tiles only once it has asked
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, process-wide); an AMX
instruction before that dies of ``SIGILL``. vLLM's CPU attention picks its
AMX kernels (``cpu_attn_amx.hpp``: ``tilezero``, ``tileloadd``) for bfloat16 KV
whenever ``torch.cpu._is_amx_tile_supported()``, and never asks: a process gets
the permission only as a side effect of oneDNN's first AMX GEMM (torch's
``brgemm``, which vLLM's linear layers call for a batch of more than a few
tokens). vLLM's own worker runs a long dummy batch at start-up, so its
attention always runs after such a GEMM; shoal's in-process worker skips that
warm-up (eager, explicit KV size), and a short first prompt reached the
attention first. :func:`request_amx_tiles` asks once, before any model step,
with torch's ``torch.cpu._init_amx`` (the same ``arch_prctl``).

Not here: which CPUs the model thread uses (:mod:`.cpu_binding`).
"""

from __future__ import annotations

import logging

__all__ = ["AmxUnavailable", "request_amx_tiles"]

log = logging.getLogger(__name__)

#: dtypes for which vLLM's CPU kernels choose AMX tiles
AMX_DTYPES = frozenset({"bfloat16"})


class AmxUnavailable(RuntimeError):
    """The CPU has AMX but the kernel refused this process the tiles: vLLM's bfloat16 kernels cannot run."""


def request_amx_tiles(dtype: str) -> bool:
    """Ask Linux for AMX tiles when the CPU has them; returns whether this process may use them.

    ``dtype`` is the model's (``bfloat16``, ``float32``, ...). Refused where the CPU has AMX and
    the model is bfloat16: :class:`AmxUnavailable`, naming the dtype that works (vLLM's attention
    would die of SIGILL at the first request); other dtypes do not use the tiles.
    """
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    if torch.cpu._init_amx():
        log.info("vllm engine: AMX tiles enabled for this process (vLLM's bfloat16 CPU kernels use them)")
        return True
    if dtype in AMX_DTYPES:
        raise AmxUnavailable(
            f"this CPU has AMX but the kernel refused the process AMX tiles (arch_prctl "
            f"ARCH_REQ_XCOMP_PERM): vLLM's {dtype} CPU attention would die of SIGILL; use --dtype float32"
        )
    return False
