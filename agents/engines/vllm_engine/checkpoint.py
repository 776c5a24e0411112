"""A small random Llama checkpoint, built locally, that vLLM and shoal's torch engine both load.

For tests, demos and the README: nothing is downloaded. The model is a
``transformers`` ``LlamaForCausalLM`` with seeded weights (scaled so that
attention matters and greedy decoding does not collapse to one token), saved
with ``save_pretrained``; the tokenizer is a byte-level BPE trained with the
``tokenizers`` library on a short built-in text and saved as
``tokenizer.json`` with a ``tokenizer_config.json`` (special tokens and a chat
template). The shape suits vLLM's CPU attention: ``head_dim`` 64.

Needs ``transformers`` and ``torch`` (the dev extra); nothing of vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CheckpointSpec", "build_checkpoint"]

_CORPUS = (
    "shoal serves large language models on many engine instances and moves requests between them. "
    "The key value cache of a request is copied block by block while it keeps decoding; the last "
    "stage is short. A global scheduler balances the freeness of the instances. Hello world! "
    "The quick brown fox jumps over the lazy dog. 0123456789 ,.;:?!'\"()[]{}<>+-*/=_ "
)
_SPECIALS = ("<s>", "</s>", "<pad>")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """The shape of the random model; the defaults make a ~0.3M-parameter, 2-layer Llama."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    seed: int = 0


def _tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Train a byte-level BPE of ``vocab_size`` tokens; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids: dict[str, int] = {}
    for token in _SPECIALS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, token
        ids[token] = token_id
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "model_max_length": 2048,
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    return ids


def build_checkpoint(folder: str | Path, spec: CheckpointSpec | None = None) -> Path:
    """Write a random Llama checkpoint and its tokenizer into ``folder`` (created); returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or CheckpointSpec()
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    special = _tokenizer(path, spec.vocab_size)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=special["<s>"],
        eos_token_id=special["</s>"],
        pad_token_id=special["<pad>"],
    )
    torch.manual_seed(spec.seed)
    model_class: Any = LlamaForCausalLM  # untyped in transformers
    model = model_class(config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                # sharper attention (q and k x3): greedy text keeps depending on the whole context
                # instead of settling into one repeated token, so a wrong KV block changes the output
                scale = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                param.copy_(scale * torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    model.to(getattr(torch, spec.dtype)).save_pretrained(path)
    return path
