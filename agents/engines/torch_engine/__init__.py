"""The built-in torch engine: a Llama-architecture model with a paged KV cache, in plain torch.

Modules: ``config`` (shapes, presets, HF config parsing), ``model`` (the
decoder), ``kv_cache`` (the paged pool and the KV buffer format), ``attention``
(attention through block tables), ``runner`` (forward passes of one step),
``sampling``, ``loader`` (checkpoints and random presets), ``core`` (the model
step, in this process or in a child process of its own) and
``engine`` (``TorchEngine``, the :class:`agents.engines.protocol.Engine` implementation).
Its tokenizers are :mod:`agents.engines.tokenizer` (shared with the frontend, no torch).
"""

from typing import TYPE_CHECKING, Any

# The light config module imports eagerly; the ones that need torch load on first use.
from agents.engines.torch_engine.config import PRESETS, ModelConfig, preset

if TYPE_CHECKING:
    from agents.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
    from agents.engines.torch_engine.kv_cache import (
        KV_BUFFER_FORMAT_VERSION,
        KVPoolShape,
        PagedKVPool,
        buffer_from_bytes,
        buffer_to_bytes,
    )
    from agents.engines.torch_engine.loader import load_model

_LAZY = {
    "TorchEngine": "engine",
    "TorchEngineConfig": "engine",
    "KV_BUFFER_FORMAT_VERSION": "kv_cache",
    "KVPoolShape": "kv_cache",
    "PagedKVPool": "kv_cache",
    "buffer_from_bytes": "kv_cache",
    "buffer_to_bytes": "kv_cache",
    "load_model": "loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

__all__ = [
    "KV_BUFFER_FORMAT_VERSION",
    "PRESETS",
    "KVPoolShape",
    "ModelConfig",
    "PagedKVPool",
    "TorchEngine",
    "TorchEngineConfig",
    "buffer_from_bytes",
    "buffer_to_bytes",
    "load_model",
    "preset",
]
