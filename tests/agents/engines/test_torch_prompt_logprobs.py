"""Prompt logprobs in the torch engine (``SamplingParams.prompt_logprobs``, vLLM's).

The logprob of each prompt token given the ones before it, and the ``k`` most likely tokens at
each position, must equal the model's dense log-softmax over the whole prompt, however the prompt
is chunked and wherever the step computes; a prompt the prefix cache holds is computed again;
``max_tokens`` 0 ends the request after its prefill with no token.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from agents.engines.protocol import FinishReason, RequestOutput
from agents.engines.torch_engine import TorchEngine
from agents.engines.torch_engine.loader import load_model
from schemas import SamplingParams

PROMPT = [256, *b"the quick brown fox jumps over the lazy dog, twice: the quick brown fox"]


@pytest.fixture(scope="module")
def dense() -> torch.Tensor:
    """The reference: log-softmax at every prompt position of the same seeded preset, no cache."""
    model = load_model("tiny", device="cpu", seed=0).model
    with torch.inference_mode():
        return model.dense_logits(torch.tensor(PROMPT)).log_softmax(-1)


def _run(engine: TorchEngine) -> Iterator[RequestOutput]:
    while engine.has_unfinished():
        yield from engine.step().outputs


def _check(output: RequestOutput, reference: torch.Tensor, k: int) -> None:
    assert output.first_index == 0
    assert output.prompt_logprobs is not None and output.prompt_top_logprobs is not None
    assert len(output.prompt_logprobs) == len(output.prompt_top_logprobs) == len(PROMPT)
    assert output.prompt_logprobs[0] is None and output.prompt_top_logprobs[0] == ()
    for position in range(1, len(PROMPT)):
        expected = reference[position - 1]
        assert output.prompt_logprobs[position] == pytest.approx(expected[PROMPT[position]].item(), abs=1e-4)
        best = expected.topk(k)
        got = output.prompt_top_logprobs[position]
        assert [t for t, _ in got] == best.indices.tolist()
        assert [v for _, v in got] == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("core", ["thread", "process"])
@pytest.mark.parametrize("step_tokens", [None, 16])
def test_prompt_logprobs_equal_the_dense_log_softmax(
    core: str, step_tokens: int | None, dense: torch.Tensor
) -> None:
    engine = TorchEngine("tiny", num_blocks=64, max_step_tokens=step_tokens, core=core)
    try:
        engine.add_request("scored", PROMPT, SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=5))
        engine.add_request("both", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
        engine.add_request("plain", PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
        outputs = list(_run(engine))
    finally:
        engine.close()
    scored = [o for o in outputs if o.request_id == "scored"]
    assert [(o.token_ids, o.finish_reason) for o in scored] == [((), FinishReason.LENGTH)]
    _check(scored[0], dense, 5)
    both = [o for o in outputs if o.request_id == "both"]
    assert [o.first_index for o in both] == [0, 1, 2]
    _check(both[0], dense, 2)
    assert all(o.prompt_logprobs is None for o in both[1:])
    assert all(o.prompt_logprobs is None for o in outputs if o.request_id == "plain")


def test_a_cached_prompt_is_computed_again_for_its_logprobs(dense: torch.Tensor) -> None:
    engine = TorchEngine("tiny", num_blocks=64, block_size=8)
    engine.add_request("first", PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    list(_run(engine))
    engine.add_request("again", PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    assert next(iter(_run(engine))).num_cached_tokens > 0  # the prompt is in the cache
    engine.add_request("scored", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))
    (output,) = _run(engine)
    assert output.num_cached_tokens == 0
    _check(output, dense, 1)


def test_a_one_token_prompt_has_one_null_prompt_logprob() -> None:
    engine = TorchEngine("tiny", num_blocks=8)
    engine.add_request("one", [65], SamplingParams(max_tokens=0, prompt_logprobs=2))
    (output,) = _run(engine)
    assert output.prompt_logprobs == (None,) and output.prompt_top_logprobs == ((),)


def test_a_rescued_request_with_tokens_computes_no_prompt_logprobs() -> None:
    engine = TorchEngine("tiny", num_blocks=64)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    engine.add_request("rescued", PROMPT, sampling, output_token_ids=[65, 66])
    outputs = list(_run(engine))
    assert [o.first_index for o in outputs] == [2, 3]
    assert all(o.prompt_logprobs is None for o in outputs)
    with pytest.raises(ValueError, match="max_tokens"):  # nothing left to generate
        engine.add_request("done", PROMPT, SamplingParams(max_tokens=0), output_token_ids=[65])
