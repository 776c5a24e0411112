"""shoal's ``SamplingParams`` as vLLM's, and which requests cannot migrate faithfully.

A request that continues after tokens it already generated (a rescued or a
migrated one) reaches vLLM as a longer prompt: ``max_tokens`` and
``min_tokens`` shrink by what was generated. That is exact for greedy and for
unseeded sampling. It is not for state vLLM keeps per request and a new
engine cannot rebuild from token ids: a seeded generator's position (vLLM
draws from a per-request ``torch.Generator``), penalties over the generated
tokens (the history becomes "prompt"). :func:`migration_blocker` names those;
the vllm engine reports such requests as not migratable and the migration
selection skips them. shoal's wire format has no structured output or prompt
logprobs, so those cannot reach the engine at all; ``n`` > 1 reaches it as one
request per choice; the sampled token's logprob and its alternatives reach it as
vLLM's ``logprobs`` (``top_logprobs``).
"""

from __future__ import annotations

from typing import Any

from schemas import SamplingParams

__all__ = ["migration_blocker", "to_vllm_sampling"]


def migration_blocker(sampling: SamplingParams) -> str | None:
    """Why a request with ``sampling`` cannot be moved to another vLLM engine faithfully, or None."""
    if sampling.temperature > 0.0 and sampling.seed is not None:
        return "seeded sampling: vLLM's per-request generator state does not move with the request"
    if sampling.repetition_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty:
        return "a penalty: vLLM would count the generated tokens as prompt after the move"
    return None


def to_vllm_sampling(sampling: SamplingParams, num_generated: int = 0) -> Any:
    """vLLM ``SamplingParams`` for the rest of a request that has ``num_generated`` tokens already."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1,
        max_tokens=sampling.max_tokens - num_generated,
        min_tokens=max(0, sampling.min_tokens - num_generated),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        # the sampled token's (vLLM's raw logprobs) and as many of the most likely as asked
        logprobs=sampling.top_logprobs if sampling.logprobs else None,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )
