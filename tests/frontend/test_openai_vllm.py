"""The official ``openai`` client against shoal with two vllm-engine agents (real NATS, one process).

A migration forced mid-stream is invisible to the client (greedy text equals
an undisturbed run, usage and finish reason unchanged); a client that
disconnects frees its blocks on every vLLM engine. The serving checks of
``test_openai_e2e`` run against ``shoal up --engine vllm`` in
``test_up_vllm``. Skipped (with the reason) where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from tests.frontend.cluster import Cluster, disconnect_after_first_text, frontend_cluster

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
    ),
]

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
async def cluster(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    model = str(build_checkpoint(tmp_path_factory.mktemp("llama")))
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
