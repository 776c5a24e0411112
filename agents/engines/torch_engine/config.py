"""Model shapes: the frozen ``ModelConfig``, the random presets, and Hugging Face config parsing.

A ``ModelConfig`` says everything the forward pass and the KV cache need to know
about a Llama-architecture model (Llama, Mistral, Qwen2 families). Random
presets are named here; Hugging Face ``config.json`` files are translated by
``model_config_from_hf``. No tensors and no I/O beyond reading a JSON dict
that the caller has already parsed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ModelConfig",
    "RopeScaling",
    "UnsupportedModelError",
    "dtype_size",
    "model_config_from_hf",
    "preset",
]

#: Token ids 0..255 are raw bytes in the byte-level tokenizer of random presets;
#: 256, 257 and 258 are BOS, EOS and PAD; ids above are reserved specials.
BYTE_VOCAB_SIZE = 256
_BOS_ID = 256
_EOS_ID = 257

_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not implemented."""


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``torch`` ("float32", "bfloat16", "float16")."""
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPE_SIZES)}") from None


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-frequency scaling. ``kind`` is "linear" or "llama3" (Llama 3.1+)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and numerics of a Llama-architecture decoder."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = _BOS_ID
    eos_token_ids: tuple[int, ...] = (_EOS_ID,)
    model_type: str = "llama"
    #: Random presets only: std of the lm_head init, large so the top-1 margin dwarfs float noise.
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size(dtype)

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _random(name: str, **shape: Any) -> ModelConfig:
    return ModelConfig(name=name, tie_word_embeddings=False, logit_scale=4.0, **shape)


#: Seeded random models. ``tiny``: tests. ``small``: serving benchmarks (enough compute
#: per decode step that the engine, not the serving path, dominates on a few CPU cores).
#: ``kv-heavy``: migration benchmarks (128 KiB of float32 KV per token, cheap compute per token).
PRESETS: Mapping[str, ModelConfig] = {
    "tiny": _random(
        "tiny", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
    ),
    "small": _random(
        "small", vocab_size=512, hidden_size=384, intermediate_size=1024, num_layers=6,
        num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
    ),
    "kv-heavy": _random(
        "kv-heavy", vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=16,
        num_heads=8, num_kv_heads=8, head_dim=128, max_position_embeddings=16384,
    ),
}


def preset(name: str) -> ModelConfig:
    """The random preset called ``name``; a clear error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = str(raw.get("rope_type", raw.get("type", "default")))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (only linear and llama3)")


def _token_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if isinstance(raw, int):
        return (raw,)
    return tuple(int(token) for token in raw)


def model_config_from_hf(raw: Mapping[str, Any], *, name: str) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2) into a ``ModelConfig``."""
    model_type = str(raw.get("model_type", "llama"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    # transformers >= 5 nests rope settings in "rope_parameters"; older files use top-level keys.
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_raw = raw.get("rope_scaling") or (rope_params if "rope_type" in rope_params else None)
    if model_type == "qwen2":
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        bias = True
    else:
        window = raw.get("sliding_window")
        bias = bool(raw.get("attention_bias", False))
    if raw.get("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    return ModelConfig(
        name=name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling_from_hf(rope_raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bias,
        sliding_window=int(window) if window else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        model_type=model_type,
    )

