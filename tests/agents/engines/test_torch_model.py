"""The torch engine's model: paged attention vs a dense reference and vs transformers, checkpoint loading,
the tokenizers and the KV pool's export/import."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engines.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from agents.engines.torch_engine.config import PRESETS, ModelConfig, UnsupportedModelError, preset
from agents.engines.torch_engine.kv_cache import KVPoolShape, PagedKVPool, buffer_from_bytes, buffer_to_bytes
from agents.engines.torch_engine.loader import CheckpointError, load_checkpoint, load_model
from agents.engines.torch_engine.model import LlamaForCausalLM, build_random_model
from agents.engines.torch_engine.runner import ModelRunner, SequenceWork

TINY = preset("tiny")


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return build_random_model(TINY, seed=0, dtype=torch.float32, device="cpu")


def _dense(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.dense_logits(torch.tensor(tokens))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_paged_forward_matches_dense_reference_for_a_batch_of_different_lengths(
    tiny_model: LlamaForCausalLM, batch_invariant: bool
) -> None:
    rng = random.Random(7)
    pool = PagedKVPool(KVPoolShape.for_model(TINY, block_size=16, dtype="float32"), 48)
    # Small passes force chunked prefill; scattered block ids exercise the block tables.
    runner = ModelRunner(tiny_model, pool, batch_invariant=batch_invariant, max_pass_tokens=24)
    free = list(range(48))
    rng.shuffle(free)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(n)] for n in (1, 5, 16, 17, 45, 70)]
    tables = [[free.pop() for _ in range(-(-(len(p) + 8) // 16))] for p in prompts]
    first = runner.logits([SequenceWork(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    sequences = [list(p) for p in prompts]
    for step in range(8):  # decode: each sequence feeds the dense argmax of the previous step
        expected = [_dense(tiny_model, s)[-1] for s in sequences]
        if step == 0:
            got = first
        else:
            got = runner.logits(
                [SequenceWork(s[-1:], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)]
            )
        for row, want in zip(got, expected, strict=True):
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
        for s, want in zip(sequences, expected, strict=True):
            s.append(int(want.argmax()))


def _hf_llama(config: ModelConfig) -> object:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
    )
    return HFLlama(hf_config).eval()


def test_random_model_matches_transformers_llama_with_the_same_weights(tiny_model: LlamaForCausalLM) -> None:
    hf = _hf_llama(TINY)
    hf.load_state_dict(tiny_model.state_dict(), strict=True)  # type: ignore[attr-defined]
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(n)] for n in (3, 20, 41)]
    engine_pool = PagedKVPool(KVPoolShape.for_model(TINY, block_size=16, dtype="float32"), 16)
    runner = ModelRunner(tiny_model, engine_pool)
    start = 0
    work = []
    for p in prompts:  # all but the last token as prefill; compare the logits of every position via dense
        blocks = list(range(start, start + 3))
        start += 3
        work.append(SequenceWork(p, 0, blocks))
    paged_last = runner.logits(work)
    with torch.inference_mode():
        for p, paged in zip(prompts, paged_last, strict=True):
            hf_logits = hf(torch.tensor([p])).logits[0].float()  # type: ignore[operator]
            torch.testing.assert_close(_dense(tiny_model, p), hf_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(paged, hf_logits[-1], atol=1e-4, rtol=1e-4)
            assert int(paged.argmax()) == int(hf_logits[-1].argmax())


def _hf_variant(kind: str) -> object:
    """A transformers model of one supported family, with weights large enough that attention matters."""
    import transformers

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, eos_token_id=257))
    elif kind == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_parameters=rope))
    elif kind == "mistral-sliding-window":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=8))
    else:  # qwen2: q/k/v biases, tied embeddings, several EOS ids
        shape["num_key_value_heads"] = 1
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**shape, tie_word_embeddings=True, rope_theta=1e6, eos_token_id=[5, 6])
        )
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "mistral-sliding-window", "qwen2"])
def test_checkpoints_saved_by_transformers_match_it_dense_and_paged(kind: str, tmp_path: Path) -> None:
    hf = _hf_variant(kind)
    hf.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    loaded = load_checkpoint(tmp_path)
    config = loaded.config
    if kind == "qwen2":
        assert config.attention_bias and config.tie_word_embeddings and config.eos_token_ids == (5, 6)
    if kind == "mistral-sliding-window":
        assert config.sliding_window == 8
    tokens = [(7 * i + 3) % 300 for i in range(40)]
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0].float()  # type: ignore[operator]
    torch.testing.assert_close(_dense(loaded.model, tokens), want, atol=2e-4, rtol=2e-4)
    # Paged: a chunked prefill of 30 tokens, then decode the remaining 10 one by one.
    pool = PagedKVPool(KVPoolShape.for_model(config, block_size=4, dtype="float32"), 16)
    runner = ModelRunner(loaded.model, pool, max_pass_tokens=12)
    table = [15, 3, 8, 0, 11, 6, 1, 13, 2, 9]
    got = [runner.logits([SequenceWork(tokens[:30], 0, table)])[0]]
    got += [runner.logits([SequenceWork([tokens[p]], p, table)])[0] for p in range(30, 40)]
    torch.testing.assert_close(torch.stack(got), want[29:], atol=2e-4, rtol=2e-4)
    assert load_model(str(tmp_path)).revision == loaded.revision  # identity is stable across loads


def test_bad_checkpoints_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "missing"))


def test_presets_have_the_promised_shapes() -> None:
    assert PRESETS["kv-heavy"].kv_bytes_per_token("float32") >= 128 * 1024
    assert PRESETS["small"].num_parameters() > 10 * PRESETS["tiny"].num_parameters()


def test_random_presets_are_seeded(tiny_model: LlamaForCausalLM) -> None:
    again = build_random_model(TINY, seed=0, dtype=torch.float32, device="cpu")
    other = build_random_model(TINY, seed=1, dtype=torch.float32, device="cpu")
    assert torch.equal(again.lm_head.weight, tiny_model.lm_head.weight)
    assert not torch.equal(other.lm_head.weight, tiny_model.lm_head.weight)


def test_random_preset_top1_margin_dwarfs_float_noise(tiny_model: LlamaForCausalLM) -> None:
    """Greedy decoding is robust: the gap between the two best logits is far above float32 noise."""
    rng = random.Random(11)
    margins = []
    for _ in range(8):
        logits = _dense(tiny_model, [rng.randrange(256) for _ in range(30)])
        top2 = logits.topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).median()))
    assert min(margins) > 1e-2  # float32 noise of these logits is ~1e-6


def test_bfloat16_model_agrees_with_float32_on_most_greedy_tokens(tiny_model: LlamaForCausalLM) -> None:
    half = load_model("tiny", dtype="bfloat16").model
    tokens = list(range(40, 80))
    agree = (_dense(half, tokens).argmax(-1) == _dense(tiny_model, tokens).argmax(-1)).float().mean()
    assert agree > 0.8


# ------------------------------------------------------------------ KV pool


def test_export_import_moves_whole_blocks_between_pools_at_other_ids() -> None:
    shape = KVPoolShape(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    source, destination = PagedKVPool(shape, 10), PagedKVPool(shape, 10)
    source.pool.copy_(torch.randn(source.pool.shape))
    destination.pool.copy_(torch.randn(destination.pool.shape))
    before = destination.pool.clone()
    buffer = source.export([7, 2, 5])
    assert buffer.is_contiguous() and buffer.shape == (3, 2, 2, 4, 2, 4)
    payload = buffer_to_bytes(buffer)
    assert payload.nbytes == 3 * shape.bytes_per_block
    destination.import_([0, 9, 4], buffer_from_bytes(bytes(payload), shape))
    for src, dst in ((7, 0), (2, 9), (5, 4)):
        assert torch.equal(destination.pool[dst], source.pool[src])
    for untouched in (1, 2, 3, 5, 6, 7, 8):
        assert torch.equal(destination.pool[untouched], before[untouched])


def test_kv_buffer_bytes_are_a_view_not_a_copy() -> None:
    shape = KVPoolShape(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype="bfloat16")
    pool = PagedKVPool(shape, 4)
    buffer = pool.export([1, 3])
    view = buffer_to_bytes(buffer)
    buffer.fill_(1.0)
    assert bytes(view[:2]) == torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="whole number"):
        buffer_from_bytes(b"\x00" * 3, shape)


# --------------------------------------------------------------- tokenizers


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = ByteTokenizer(TINY.vocab_size)
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials() -> None:
    tokenizer = load_tokenizer("tiny")
    assert tokenizer.eos_token_ids == TINY.eos_token_ids and tokenizer.vocab_size == TINY.vocab_size
    assert tokenizer.encode("<|eos|>") == list(b"<|eos|>")  # text never becomes a special token
    assert tokenizer.decode([256, 104, 105, 257]) == "hi"
    assert tokenizer.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([TINY.vocab_size])


def test_checkpoint_tokenizer_loads_from_the_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                    "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"})
    )
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.encode("hello world") == [0, 2, 3]
    assert tokenizer.eos_token_ids == (1,)
    assert load_tokenizer(str(tmp_path)).encode("world", add_special_tokens=False) == [3]
