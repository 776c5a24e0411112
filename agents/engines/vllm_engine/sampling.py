"""shoal's ``SamplingParams`` as vLLM's, and which requests cannot migrate faithfully.

A request that continues after tokens it already generated (a rescued or a
migrated one) reaches vLLM as a longer prompt: ``max_tokens`` and
``min_tokens`` shrink by what was generated, and prompt logprobs are not asked
again (the first output delivered them). That is exact for greedy and for
unseeded sampling, with ``min_p`` and ``logit_bias`` (functions of the logits
alone). A grammar (``structured``) is vLLM's structured outputs; the engine
advances a continued request's grammar over the generated tokens before its
first step (:mod:`.structured`), so it continues in the state it left. It is not
exact for state vLLM keeps per request and a new engine cannot rebuild from
token ids: a seeded generator's position (vLLM draws from a per-request
``torch.Generator``), penalties over the generated tokens (the history becomes
"prompt"). :func:`migration_blocker` names those; the vllm engine reports such
requests as not migratable and the migration selection skips them. ``n`` > 1
reaches the engine as one request per choice; the sampled token's logprob and
its alternatives reach it as vLLM's ``logprobs`` (``top_logprobs``).

``max_tokens`` 0 (a fresh request that wants its prompt logprobs only) runs as
1: vLLM generates at least one token, and the engine drops it, as ``vllm
serve`` does for ``echo`` with ``max_tokens`` 0.
"""

from __future__ import annotations

import json
from typing import Any

from schemas import SamplingParams, StructuredKind, StructuredOutput

__all__ = ["migration_blocker", "to_vllm_sampling", "to_vllm_structured"]


def migration_blocker(sampling: SamplingParams) -> str | None:
    """Why a request with ``sampling`` cannot be moved to another vLLM engine faithfully, or None."""
    if sampling.temperature > 0.0 and sampling.seed is not None:
        return "seeded sampling: vLLM's per-request generator state does not move with the request"
    if sampling.repetition_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty:
        return "a penalty: vLLM would count the generated tokens as prompt after the move"
    return None


def to_vllm_structured(structured: StructuredOutput) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a constraint; ValueError for a choice spec that is
    not a JSON list of strings."""
    from vllm.sampling_params import StructuredOutputsParams

    kind, compact = structured.kind, not structured.any_whitespace
    if kind is StructuredKind.JSON_SCHEMA:
        return StructuredOutputsParams(json=structured.spec, disable_any_whitespace=compact)
    if kind is StructuredKind.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    if kind is StructuredKind.REGEX:
        return StructuredOutputsParams(regex=structured.spec)
    if kind is StructuredKind.CHOICE:
        try:
            choices = json.loads(structured.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"choice: not a JSON list of strings ({exc})") from exc
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice: not a JSON list of strings")
        return StructuredOutputsParams(choice=choices)
    return StructuredOutputsParams(grammar=structured.spec)


def to_vllm_sampling(sampling: SamplingParams, num_generated: int = 0) -> Any:
    """vLLM ``SamplingParams`` for the rest of a request that has ``num_generated`` tokens already."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    fresh = num_generated == 0
    return VllmSamplingParams(
        n=1,
        # max_tokens 0 (prompt logprobs only) runs one token, which the engine drops
        max_tokens=max(sampling.max_tokens - num_generated, 1 if fresh else 0),
        min_tokens=max(0, sampling.min_tokens - num_generated),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logit_bias=dict(sampling.logit_bias) or None,
        structured_outputs=None if sampling.structured is None else to_vllm_structured(sampling.structured),
        # the sampled token's (vLLM's raw logprobs) and as many of the most likely as asked
        logprobs=sampling.top_logprobs if sampling.logprobs else None,
        # delivered with the first output; a continuation does not compute them again
        prompt_logprobs=sampling.prompt_logprobs if fresh else None,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
    )
