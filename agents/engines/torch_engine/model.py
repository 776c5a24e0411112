"""The Llama-architecture decoder in plain torch: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Module and parameter names match Hugging Face's ``LlamaForCausalLM`` (and the
Mistral / Qwen2 variants), so a checkpoint's state dict loads as is. The model
does not know about paging: ``LlamaForCausalLM.hidden_states`` takes a flat
list of tokens with their positions and an ``Attend`` callback that writes
K/V wherever it keeps them and returns the attention output
(``attention.PagedAttention`` reads through block tables;
``dense_attention`` is the no-paging reference). Random presets are built
here from a seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agents.engines.torch_engine.config import ModelConfig

__all__ = [
    "Attend",
    "LlamaForCausalLM",
    "RMSNorm",
    "apply_rotary",
    "build_random_model",
    "dense_attention",
    "rope_inverse_frequencies",
    "rotary_tables",
    "rotate",
]

#: ``attend(layer, q [T, heads, head_dim], k [T, kv_heads, head_dim], v) -> [T, heads * head_dim]``
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:
    """Per-pair rotary inverse frequencies (float32), with linear or llama3 scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    band = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` [T, 1, D] of ``positions`` [T] in ``dtype``: once per pass, for every layer."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] by the tables of :func:`rotary_tables`."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] by ``positions`` [T] (HF's half-split layout)."""
    cos, sin = rotary_tables(positions, inv_freq, q.dtype)
    return rotate(q, k, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Weights with Hugging Face names; forward over a flat token list through an ``Attend`` callback."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Kept out of the state dict and out of ``.to(dtype)``: rotary frequencies stay float32.
        self._inv_freq = rope_inverse_frequencies(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def hidden_states(self, input_ids: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Last-layer hidden states [T, hidden] (before the final norm) of ``input_ids`` at ``positions``."""
        config = self.config
        num_tokens = input_ids.shape[0]
        x: Tensor = self.model.embed_tokens(input_ids)
        inv_freq = self._inv_freq
        if inv_freq.device != input_ids.device:
            inv_freq = self._inv_freq = inv_freq.to(input_ids.device)
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        cos, sin = rotary_tables(positions, inv_freq, x.dtype)
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(num_tokens, config.num_heads, config.head_dim)
            k = attn.k_proj(h).view(num_tokens, config.num_kv_heads, config.head_dim)
            v = attn.v_proj(h).view(num_tokens, config.num_kv_heads, config.head_dim)
            q, k = rotate(q, k, cos, sin)
            x = x + attn.o_proj(attend(index, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [N, vocab] for the rows of ``hidden`` [N, hidden] that need sampling."""
        logits: Tensor = self.lm_head(self.model.norm(hidden))
        return logits.float()

    def dense_logits(self, token_ids: Tensor) -> Tensor:
        """Reference forward of one sequence without any cache: float32 logits for every position."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)

        def attend(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return dense_attention(q, k, v, sliding_window=self.config.sliding_window)

        return self.logits(self.hidden_states(token_ids, positions, attend))


def dense_attention(q: Tensor, k: Tensor, v: Tensor, *, sliding_window: int | None = None) -> Tensor:
    """Plain causal attention of one whole sequence (the no-paging reference), in float32."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) / head_dim**0.5
    query_pos = torch.arange(num_tokens, device=q.device)[:, None]
    key_pos = torch.arange(num_tokens, device=q.device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    out: Tensor = scores.softmax(-1) @ vf  # [H, T, D]
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim).to(q.dtype)


@torch.no_grad()
def build_random_model(
    config: ModelConfig, *, seed: int, dtype: torch.dtype, device: torch.device | str
) -> LlamaForCausalLM:
    """A seeded random model: weights are drawn on the CPU in float32, so they do not depend on the device.

    Projections use std 1/sqrt(fan_in) so attention and MLP change the residual
    stream as much as the embeddings do (attention bugs change the output);
    the lm_head's std ``logit_scale/sqrt(hidden)`` makes logits spread by
    ~``logit_scale``, so the top-1 margin is orders of magnitude above float noise.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            param.fill_(1.0)
        elif name == "model.embed_tokens.weight":
            param.normal_(0.0, 1.0, generator=generator)
        elif name == "lm_head.weight":
            param.normal_(0.0, config.logit_scale / config.hidden_size**0.5, generator=generator)
        elif name.endswith(".bias"):
            param.normal_(0.0, 0.1, generator=generator)
        else:
            param.normal_(0.0, 1.0 / param.shape[1] ** 0.5, generator=generator)
    model.to(device=device, dtype=dtype)
    return model.eval()
