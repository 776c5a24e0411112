"""The official ``openai`` client against shoal with two vllm-engine agents (real NATS, one process).

A migration forced mid-stream is invisible to the client (greedy text equals
an undisturbed run, usage and finish reason unchanged), a constrained one too,
and one rescued after its agent is killed;
a client that disconnects frees its blocks on every vLLM engine. 50 random JSON
schemas answered streamed and not validate; logit_bias forces and forbids
tokens; ``echo`` with ``max_tokens`` 0 scores the prompt as vLLM's own
``LLM.generate`` does (what ``vllm serve`` answers). The serving checks of
``test_openai_e2e`` run against ``shoal up --engine vllm`` in
``test_up_vllm``. Skipped (with the reason) where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from tests.frontend.cluster import Cluster, disconnect_after_first_text, frontend_cluster
from tests.frontend.test_openai_structured import random_schema

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
    ),
]

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Give me the record as JSON."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_checkpoint(tmp_path_factory.mktemp("llama")))


PROMPT_IDS = [1, 15, 27, 300, 42, 7, 99, 250, 3, 18]


@pytest.fixture(scope="module")
def vllm_prompt_logprobs(checkpoint: str) -> list[dict[int, Any] | None]:
    """vLLM's own ``LLM.generate`` prompt logprobs (5 alternatives) for PROMPT_IDS, on the cluster's
    checkpoint: what ``vllm serve`` answers ``echo`` with, without the HTTP (see STATUS.md). Built and
    shut down before the agents' engines: its shutdown tears down vLLM's process-wide groups."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its engine in this process, as the agents' are
    llm = LLM(model=checkpoint, block_size=32, max_model_len=512, dtype="float32",
              enforce_eager=True, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
    try:
        params = VllmSamplingParams(max_tokens=1, prompt_logprobs=5)
        output = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return list(output.prompt_logprobs or ())


@pytest.fixture(scope="module")
async def cluster(
    nats_url: str, checkpoint: str, vllm_prompt_logprobs: list[dict[int, Any] | None]
) -> AsyncIterator[Cluster]:
    model = checkpoint
    async with frontend_cluster(nats_url, instances=2, engine="vllm", engine_options={"model": model},
                                max_model_len=512) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running
        for agent in running.agents.values():
            agent.engine.shutdown()


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


async def _stream_text(client: Any, model: str, **kwargs: Any) -> tuple[str, list[str], Any]:
    parts: list[str] = []
    finish: list[str] = []
    usage = None
    stream = await client.completions.create(model=model, prompt=PROMPT, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.text)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish, usage


async def _owner_after_first_token(cluster: Cluster, before: set[str]) -> tuple[str, str]:
    gateway = cluster.gateway
    assert gateway is not None
    for _ in range(2000):
        for request_id, stream in list(gateway.streams.items()):
            if request_id not in before and len(stream.generated) >= 20 and stream.owner_id:
                return request_id, stream.owner_id
        await asyncio.sleep(0.005)
    raise AssertionError("no request produced 20 tokens")


async def test_migration_mid_stream_is_invisible(cluster: Cluster, client: Any) -> None:
    model = cluster.config.model
    reference, _, _ = await _stream_text(client, model, max_tokens=200, temperature=0)
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.01  # still running when the migration ends: 180 tokens >= 1.8 s
    task = asyncio.ensure_future(_stream_text(client, model, max_tokens=200, temperature=0))
    request_id, owner = await _owner_after_first_token(cluster, before)
    other = next(i for i in cluster.agents if i != owner)
    outcome = await cluster.agents[owner].migrate(request_id, other)
    cluster.pace.release()
    text, finish, usage = await task
    assert outcome.migrated, outcome
    assert text == reference
    assert usage.completion_tokens == 200 and finish == ["length"]


def _torch_reference(model: str, prompt: list[int], **sampling: Any) -> list[float]:
    """The built-in torch engine's logprobs for ``prompt`` on the same checkpoint (float32)."""
    from agents.engines.torch_engine import TorchEngine
    from schemas import SamplingParams

    reference = TorchEngine(model, num_blocks=16, dtype="float32")
    reference.add_request("r", prompt, SamplingParams(ignore_eos=True, logprobs=True, **sampling))
    expected: list[float] = []
    while reference.has_unfinished():
        for out in reference.step().outputs:
            expected += out.logprobs or ()
            for alternatives in out.top_logprobs or ():
                expected += [v for _, v in alternatives]
    reference.close()
    return expected


async def test_logprobs_are_the_sampled_tokens_under_the_model(cluster: Cluster, client: Any) -> None:
    # vLLM's sampled-token logprobs reach the client, streamed or not, and equal the built-in torch
    # engine's for the same checkpoint (float32 both): the same model's log-softmax at each token
    model, prompt = cluster.config.model, [1, 15, 27, 300, 42]
    asked = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
             "extra_body": {"ignore_eos": True}}
    whole = (await client.completions.create(**asked)).choices[0].logprobs
    streamed = [v for chunk in await _chunks(client, asked) for choice in chunk.choices
                if choice.logprobs for v in choice.logprobs.token_logprobs]
    expected = _torch_reference(model, prompt, max_tokens=8)
    assert len(whole.token_logprobs) == 8 and all(v <= 0 for v in whole.token_logprobs)
    assert whole.token_logprobs == pytest.approx(expected, abs=2e-3)
    assert streamed == pytest.approx(whole.token_logprobs, abs=1e-6)
    # the 3 most likely tokens at each position, as the torch engine ranks them (greedy: the first is
    # the pick), in the chat format
    chat = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
               and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
               for t in content)
    ranked = (await client.completions.create(**{**asked, "logprobs": 3})).choices[0].logprobs
    reference = _torch_reference(model, prompt, max_tokens=8, top_logprobs=3)  # per token: pick, top 3
    for i, top in enumerate(ranked.top_logprobs):  # keyed by text: tokens of the same text share a key
        best = reference[4 * i + 1 : 4 * i + 4]
        assert max(top.values()) == pytest.approx(best[0], abs=2e-3)
        assert all(any(abs(v - b) < 2e-3 for b in best) for v in top.values())


async def test_presence_and_frequency_penalties_pick_the_tokens_the_torch_engine_picks(
    cluster: Cluster, client: Any
) -> None:
    # greedy with penalties on the generated tokens: the same tokens as the torch engine's sampler (the
    # raw logprobs of the picks, compared, stand for the picks), and other tokens than without them
    model, prompt = cluster.config.model, [1, 15, 27, 300, 42]
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    asked = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1,
             "extra_body": {"ignore_eos": True}}
    plain = (await client.completions.create(**asked)).choices[0]
    penalised = (await client.completions.create(**asked, **penalties)).choices[0]
    assert penalised.text != plain.text
    expected = _torch_reference(model, prompt, max_tokens=24, **penalties)
    assert penalised.logprobs.token_logprobs == pytest.approx(expected, abs=2e-3)


async def _chunks(client: Any, asked: dict[str, Any]) -> list[Any]:
    return [chunk async for chunk in await client.completions.create(stream=True, **asked)]


async def test_client_disconnect_aborts_and_frees_blocks(cluster: Cluster) -> None:
    url = cluster.base_url  # type: ignore[attr-defined]
    body = {"model": cluster.config.model, "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    cluster.pace.min_step_s = 0.01  # still running when the client hangs up: 400 tokens >= 4 s
    try:
        await disconnect_after_first_text(cluster, url, body, polls=500)
    finally:
        cluster.pace.release()
    assert not any(agent.engine.has_unfinished() for agent in cluster.agents.values())
    free = [agent.engine.stats().num_free_blocks for agent in cluster.agents.values()]
    total = [agent.engine.stats().num_total_blocks for agent in cluster.agents.values()]
    assert free == total


# ----------------------------------------------- structured outputs, logit bias, prompt logprobs


def _quiet_bias(model: str) -> dict[str, int]:
    """logit_bias -100 on the checkpoint's tokens that are only whitespace or hold a control
    character: JSON between its tokens becomes compact (a random model writes whitespace wherever
    JSON allows it), and no raw control character lands in a string
    with a length bound (xgrammar 0.2.8 writes those strings as ``[^"\\\\\\r\\n]{m,n}``, which lets
    them through: strict JSON parsers refuse the text, ``vllm serve`` answers the same)."""
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    special = {tokenizer.token_to_id(token) for token in ("<s>", "</s>", "<pad>")}
    texts = {i: tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size()) if i not in special}
    return {str(i): -100 for i, text in texts.items() if text.strip() == "" or any(ord(c) < 32 for c in text)}


async def _chat_text(client: Any, model: str, **kwargs: Any) -> tuple[str, list[str]]:
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs)
    parts, finish = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish


async def test_fifty_random_json_schemas_streamed_and_not_validate(cluster: Cluster, client: Any) -> None:
    model = cluster.config.model
    rng = random.Random(39)
    schemas = [random_schema(rng) for _ in range(50)]
    bias = _quiet_bias(model)
    options = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": s}},
         "max_tokens": 400, "temperature": 1.0, "seed": i, "logit_bias": bias}
        for i, s in enumerate(schemas)
    ]
    create = client.chat.completions.create
    plain = asyncio.gather(*(create(model=model, messages=MESSAGES, **o) for o in options))
    streamed = asyncio.gather(*(_chat_text(client, model, **o) for o in options))
    replies, streams = await asyncio.gather(plain, streamed)
    unfinished = [(s, r.choices[0].message.content) for s, r in zip(schemas, replies, strict=True)
                  if r.choices[0].finish_reason != "stop"]
    assert not unfinished, (len(unfinished), unfinished[:2])
    for schema, reply, (text, finish) in zip(schemas, replies, streams, strict=True):
        content = reply.choices[0].message.content
        jsonschema.validate(json.loads(content), schema)
        assert finish == ["stop"] and text == content  # the same seed: the same JSON streamed


#: a greedy answer of at least 60 tokens that ends when the array does
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 60, "maxItems": 60}


async def test_a_constrained_request_migrated_mid_stream_returns_the_unmigrated_text(
    cluster: Cluster, client: Any
) -> None:
    model = cluster.config.model
    asked = {"max_tokens": 300, "temperature": 0, "logit_bias": _quiet_bias(model),
             "response_format": {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS}}}
    reference, finish = await _chat_text(client, model, **asked)
    jsonschema.validate(json.loads(reference), DIGITS)
    assert finish == ["stop"]
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.01  # still running when the migration ends
    task = asyncio.ensure_future(_chat_text(client, model, **asked))
    request_id, owner = await _owner_after_first_token(cluster, before)
    other = next(i for i in cluster.agents if i != owner)
    outcome = await cluster.agents[owner].migrate(request_id, other)
    cluster.pace.release()
    text, finish = await task
    assert outcome.migrated, outcome
    assert (text, finish) == (reference, ["stop"])


async def test_logit_bias_forces_and_forbids_tokens(cluster: Cluster, client: Any) -> None:
    model = cluster.config.model
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    asked = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
             "extra_body": {"ignore_eos": True}}
    forced = await client.completions.create(**asked, logit_bias={"77": 100})
    assert forced.choices[0].text == tokenizer.decode([77] * 6)
    # two tokens pushed up, the first of them forbidden: only the second is left
    forbidden = await client.completions.create(**asked, logit_bias={"77": -100, "78": 100})
    assert forbidden.choices[0].text == tokenizer.decode([78] * 6)


async def test_echo_with_max_tokens_0_scores_the_prompt_as_vllm_does(
    cluster: Cluster, client: Any, vllm_prompt_logprobs: list[dict[int, Any] | None]
) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs equal vLLM's own."""
    tokenizer = Tokenizer.from_file(str(Path(cluster.config.model) / "tokenizer.json"))
    reply = await client.completions.create(model=cluster.config.model, prompt=PROMPT_IDS, echo=True,
                                            max_tokens=0, logprobs=5)
    choice = reply.choices[0]
    # the prompt's text as vLLM's server echoes it: special tokens included
    assert choice.finish_reason == "length"
    assert choice.text == tokenizer.decode(PROMPT_IDS, skip_special_tokens=False)
    scored = choice.logprobs
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert len(scored.token_logprobs) == len(PROMPT_IDS) == len(vllm_prompt_logprobs)
    for position in range(1, len(PROMPT_IDS)):
        expected = vllm_prompt_logprobs[position]
        assert expected is not None
        own = expected[PROMPT_IDS[position]].logprob
        assert scored.token_logprobs[position] == pytest.approx(own, abs=1e-5)
        # keyed by text, as vLLM's server keys them: tokens of one text share a key (vLLM's server
        # keeps the last of them, the prompt token first, then by rank) and a token that is part of a
        # character is "" (shoal writes the replacement character)
        by_text: dict[str, list[float]] = {}
        for lp in expected.values():
            by_text.setdefault(lp.decoded_token, []).append(lp.logprob)
        top = {key.replace("\ufffd", ""): value for key, value in scored.top_logprobs[position].items()}
        assert top.keys() == by_text.keys()
        for key, value in top.items():
            assert any(abs(value - candidate) < 1e-5 for candidate in by_text[key]), (position, key)


async def test_a_constrained_request_rescued_after_its_agent_dies_returns_the_same_text(
    cluster: Cluster, client: Any
) -> None:
    """The agent running a greedy json_schema request is killed mid-stream: another vLLM agent takes
    it over from the tokens so far, under the same grammar state, and the text is unchanged. A third
    agent joins first, so two stay alive for the tests after this one."""
    model = cluster.config.model
    asked = {"max_tokens": 300, "temperature": 0, "logit_bias": _quiet_bias(model),
             "response_format": {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS}}}
    reference, _ = await _chat_text(client, model, **asked)
    await cluster.add_agent("i2", model=model)
    await cluster.wait_instances(3)
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.01  # still running when its agent dies
    task = asyncio.ensure_future(_chat_text(client, model, **asked))
    request_id, owner = await _owner_after_first_token(cluster, before)
    stream = cluster.gateway.streams[request_id]  # type: ignore[union-attr]
    victim = cluster.agents.pop(owner)
    await victim.kill()
    cluster.pace.release()
    try:
        text, finish = await asyncio.wait_for(task, 60)
    finally:
        victim.engine.shutdown()
    assert stream.num_rescues >= 1 and stream.owner_id != owner
    assert (text, finish) == (reference, ["stop"])
    jsonschema.validate(json.loads(text), DIGITS)
