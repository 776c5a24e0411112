"""The torch engine's sampler: greedy, temperature, top-k, top-p, min-p, repetition penalty, min_tokens
bans, logit bias, the grammar mask, and counter-based randomness that depends only on (seed, token index)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agents.engines.torch_engine.sampling import (
    SamplingRow,
    check_sampling_params,
    noise_seed,
    refused_mask,
    request_seed,
    sample,
    unpack_refused,
)
from schemas import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _rows(params: SamplingParams, seeds: range, index: int = 0) -> list[SamplingRow]:
    return [SamplingRow(params, seed, index) for seed in seeds]


def _frequencies(params: SamplingParams, n: int = 3000) -> torch.Tensor:
    tokens = sample(LOGITS.expand(n, -1), _rows(params, range(n))).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=4).float() / n


def test_temperature_one_samples_from_the_model_distribution() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, PROBS, atol=0.03)


def test_low_temperature_sharpens_and_greedy_is_argmax() -> None:
    assert _frequencies(SamplingParams(temperature=0.25))[0] > 0.8
    logits = torch.randn(5, 50)
    assert sample(logits, _rows(SamplingParams(), range(5))).token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_cut_the_tail() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.04)
    # mass above token 2 is 0.8 > 0.7: tokens 0 and 1 survive
    freq = _frequencies(SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    assert _frequencies(SamplingParams(temperature=1.0, top_p=0.01))[0] == 1.0
    assert _frequencies(SamplingParams(temperature=5.0, top_k=1), n=200)[0] == 1.0


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.6, -1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    assert sample(logits, [SamplingRow(params, 0, 0, history=(0,))]).token_ids == [1]  # 3/2 < 2
    assert sample(logits, [SamplingRow(params, 0, 0, history=(0, 1))]).token_ids == [2]
    assert sample(logits, [SamplingRow(SamplingParams(), 0, 0, history=(0, 1))]).token_ids == [0]


def test_banned_tokens_are_never_chosen() -> None:
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, seed, 0, banned_token_ids=(0, 1)) for seed in range(500)]
    tokens = sample(LOGITS.expand(500, -1), rows).token_ids
    assert set(tokens) <= {2, 3}
    assert sample(LOGITS[None], [SamplingRow(SamplingParams(), 0, 0, banned_token_ids=(0,))]).token_ids == [1]


def test_randomness_depends_only_on_seed_and_token_index() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)  # uniform: the token is pure noise
    alone = sample(logits, [SamplingRow(params, 42, 7)]).token_ids[0]
    others = [SamplingRow(SamplingParams(temperature=0.7, top_p=0.9), s, s) for s in range(6)]
    batch = [*others[:3], SamplingRow(params, 42, 7), *others[3:]]
    assert sample(logits.expand(7, -1), batch).token_ids[3] == alone
    next_tokens = {sample(logits, [SamplingRow(params, 42, i)]).token_ids[0] for i in range(20)}
    assert len(next_tokens) > 15  # a fresh draw per index
    assert len({noise_seed(42, i) for i in range(1000)} | {noise_seed(43, i) for i in range(1000)}) == 2000


def test_requests_without_a_seed_get_one_from_their_id() -> None:
    assert request_seed("req-1", None) == request_seed("req-1", None) != request_seed("req-2", None)
    assert request_seed("req-1", 5) == 5


def test_logprobs_are_those_of_the_raw_distribution_for_the_rows_that_ask() -> None:
    asks, quiet = SamplingParams(logprobs=True), SamplingParams()
    result = sample(LOGITS.expand(2, -1), [SamplingRow(quiet, 0, 0), SamplingRow(asks, 0, 0)])
    assert result.token_ids == [0, 0] and result.logprobs[0] is None
    assert result.logprobs[1] is not None and math.isclose(result.logprobs[1], math.log(0.5), rel_tol=1e-5)
    assert sample(LOGITS[None], [SamplingRow(quiet, 0, 0)]).logprobs == []  # none asks: none computed


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=0), "top_k"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_sampling_params_are_named(params: SamplingParams, problem: str) -> None:
    message = check_sampling_params(params)
    assert message is not None and problem in message
    assert check_sampling_params(SamplingParams(temperature=0.8, top_p=0.9, top_k=50)) is None


def test_presence_and_frequency_penalties_count_the_generated_tokens_only() -> None:
    # logits log(0.5), log(0.3): token 0 leads token 1 by 0.51. Prompt [0, 0, 2], generated [0, 3].
    history = (0, 0, 2, 0, 3)

    def greedy(*, frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> int:
        params = SamplingParams(frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
        row = SamplingRow(params, seed=0, output_index=2, history=history)
        return sample(LOGITS[None], [row]).token_ids[0]

    assert greedy() == 0
    assert greedy(frequency_penalty=0.4) == 0  # one generated 0: 0.4 < 0.51 (the prompt's two not counted)
    assert greedy(frequency_penalty=0.6) == 1
    assert greedy(presence_penalty=0.6) == 1
    assert greedy(presence_penalty=-2.0, frequency_penalty=0.4) == 0  # a negative one favours it
    first = SamplingRow(SamplingParams(frequency_penalty=2.0), seed=0, output_index=0, history=(0, 0, 2))
    assert sample(LOGITS[None], [first]).token_ids == [0]  # nothing generated yet: nothing to penalise
    assert "presence_penalty" in (check_sampling_params(SamplingParams(presence_penalty=2.5)) or "")


def _bitmask(allowed: list[int], words: int) -> np.ndarray:
    mask = np.zeros(words, dtype=np.uint32)
    for token in allowed:
        mask[token // 32] |= np.uint32(1 << (token % 32))
    return mask.view(np.int32)


def test_the_grammar_mask_leaves_only_its_ids_and_ids_past_it_are_refused() -> None:
    logits = torch.arange(70, dtype=torch.float32)[None].repeat(3, 1)  # the highest id is the greedy pick
    rows = [
        SamplingRow(SamplingParams(), 0, 0, allowed=_bitmask([3, 40], 2)),
        SamplingRow(SamplingParams(temperature=1.0), 5, 0, allowed=_bitmask([7], 2)),
        SamplingRow(SamplingParams(), 0, 0),  # no grammar: unchanged
    ]
    assert sample(logits, rows).token_ids == [40, 7, 69]
    # a mask of two words covers ids 0..63: the vocabulary's ids 64..69 are refused
    short = SamplingRow(SamplingParams(), 0, 0, allowed=_bitmask([63], 2))
    assert sample(logits[:1], [short]).token_ids == [63]
    # a grammar that allows only what min_tokens bans wins (the scheduler stops a complete grammar)
    banned = SamplingRow(SamplingParams(), 0, 0, banned_token_ids=(3,), allowed=_bitmask([3], 3))
    assert sample(logits[:1], [banned]).token_ids == [3]
    # the unpacking off the CPU (the words cross to the device) reads the same bits
    words = np.stack([_bitmask([0, 31, 32, 63], 2), _bitmask([5], 2)])
    expected = refused_mask(list(words), 64, torch.device("cpu"))
    assert torch.equal(unpack_refused(torch.from_numpy(words)), expected)
    assert expected[0].logical_not().nonzero().flatten().tolist() == [0, 31, 32, 63]
    # logprobs stay those of the raw model distribution
    wanted = SamplingRow(SamplingParams(logprobs=True), 0, 0, allowed=_bitmask([3], 3))
    assert sample(logits[:1], [wanted]).logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[3]))


def test_logit_bias_is_added_before_the_penalties_as_in_vllm() -> None:
    logits = torch.tensor([[4.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((0, -2.0),))
    # (4 - 2) / 2 = 1 > 0.5; penalty first would give 4 / 2 - 2 = 0 < 0.5
    assert sample(logits, [SamplingRow(params, 0, 0, history=(0,))]).token_ids == [0]
    assert sample(logits, [SamplingRow(SamplingParams(logit_bias=((1, 3.6),)), 0, 0)]).token_ids == [1]
    assert check_sampling_params(SamplingParams(logit_bias=((1, -100.0), (2, 100.0)))) is None
    assert "logit_bias" in (check_sampling_params(SamplingParams(logit_bias=((1, -100.5),))) or "")


def test_min_p_drops_what_is_below_its_share_of_the_top_probability_after_temperature() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps 0 and 1 (0.3 >= 0.25), renormalised
    freq = _frequencies(SamplingParams(temperature=1.0, min_p=0.5))
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], torch.tensor([0.625, 0.375]), atol=0.04)
    # at temperature 2 the probabilities flatten (0.37, 0.29, 0.20, 0.12): min_p 0.5 keeps three
    freq = _frequencies(SamplingParams(temperature=2.0, min_p=0.5))
    assert freq[3] == 0 and freq[2] > 0.1
    assert check_sampling_params(SamplingParams(min_p=1.0)) is None
    assert "min_p" in (check_sampling_params(SamplingParams(min_p=-0.1)) or "")
