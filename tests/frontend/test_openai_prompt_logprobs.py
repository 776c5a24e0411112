"""Prompt logprobs and echo through the official ``openai`` client (torch ``tiny`` agents, real NATS).

What lm-evaluation-harness's ``local-completions`` sends to score a continuation: ``echo`` with
``logprobs`` k and ``max_tokens`` 0 (or a few generated tokens), prompts as text or token ids,
one or a batch. The prompt's logprobs and its k alternatives must equal the model's dense
log-softmax over the prompt, on a prompt the prefix cache holds too; the text is the prompt then
the completion, and the logprobs cover both. vLLM's ``prompt_logprobs`` field keys them by token id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import torch

from agents.engines.torch_engine.loader import load_model
from tests.frontend.cluster import Cluster, frontend_cluster

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog; the quick brown fox jumps again."
BYTES = list(PROMPT.encode())  # the tiny preset's byte tokenizer: one token per byte, no BOS


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("tiny", device="cpu", seed=0).model  # the agents' model: same preset, same seed


def dense(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Log-softmax at every position of ``token_ids``, computed directly without any cache."""
    with torch.inference_mode():
        return model.dense_logits(torch.tensor(token_ids)).log_softmax(-1)


@pytest.fixture(scope="module")
async def cluster(nats_url: str) -> AsyncIterator[Cluster]:
    async with frontend_cluster(nats_url, instances=1, engine="torch", max_model_len=512) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


def check_prompt_logprobs(logprobs: Any, token_ids: list[int], reference: torch.Tensor, k: int) -> None:
    """The prompt's part of an echoed choice's logprobs against the dense reference."""
    assert logprobs.tokens[: len(token_ids)] == [bytes([t]).decode("utf-8", "replace") for t in token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(token_ids)):
        expected = reference[position - 1]
        value = expected[token_ids[position]].item()
        assert logprobs.token_logprobs[position] == pytest.approx(value, abs=1e-4)
        top = logprobs.top_logprobs[position]
        best = expected.topk(k).values.tolist()
        assert top[logprobs.tokens[position]] == pytest.approx(value, abs=1e-4)  # the token itself
        assert max(top.values()) == pytest.approx(max(best[0], value), abs=1e-4)  # lm-eval's is_greedy
        assert all(any(v == pytest.approx(b, abs=1e-4) for b in [*best, value]) for v in top.values())
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset[: len(token_ids)] == offsets[: len(token_ids)]


def check_vllm_field(field: list[Any], token_ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's ``prompt_logprobs``: per position the prompt token and the k most likely, by token id."""
    assert len(field) == len(token_ids) and field[0] is None
    for position in range(1, len(token_ids)):
        expected = reference[position - 1]
        entry = field[position]
        token = str(token_ids[position])
        assert entry[token]["logprob"] == pytest.approx(expected[token_ids[position]].item(), abs=1e-4)
        best = expected.topk(k)
        for rank, (token_id, value) in enumerate(
            zip(best.indices.tolist(), best.values.tolist(), strict=True), 1
        ):
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(token_id)]["rank"] == rank
        assert set(entry) == {token, *map(str, best.indices.tolist())}


async def test_echo_without_generation_scores_the_prompt_as_the_dense_model(client: Any, model: Any) -> None:
    reply = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        echo=True,
        max_tokens=0,
        logprobs=5,
        temperature=0,
        extra_body={"prompt_logprobs": 5},
    )
    (choice,) = reply.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(BYTES) and reply.usage.completion_tokens == 0
    reference = dense(model, BYTES)
    assert len(choice.logprobs.tokens) == len(BYTES)
    check_prompt_logprobs(choice.logprobs, BYTES, reference, 5)
    check_vllm_field(choice.model_extra["prompt_logprobs"], BYTES, reference, 5)
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=5, temperature=0, stream=True
    )
    (chunk,) = [chunk.choices[0] async for chunk in stream if chunk.choices]  # one chunk: the prompt
    assert chunk.text == PROMPT and chunk.finish_reason == "length"
    assert chunk.logprobs.token_logprobs == choice.logprobs.token_logprobs


async def test_echo_with_generation_returns_prompt_then_completion(client: Any, model: Any) -> None:
    plain = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, temperature=0
    )
    echoed = await client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, max_tokens=8, logprobs=2, temperature=0
    )
    generated = plain.choices[0]
    choice = echoed.choices[0]
    assert choice.text == PROMPT + generated.text
    assert echoed.usage.completion_tokens == 8
    check_prompt_logprobs(choice.logprobs, BYTES, dense(model, BYTES), 2)
    tail = len(BYTES)
    assert choice.logprobs.tokens[tail:] == generated.logprobs.tokens
    assert choice.logprobs.token_logprobs[tail:] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-5)
    assert choice.logprobs.text_offset[tail:] == [len(PROMPT) + o for o in generated.logprobs.text_offset]
    # streamed: the first chunk carries the prompt, the chunks join into the same text and logprobs
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, max_tokens=8, logprobs=2, temperature=0, stream=True
    )
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets[:tail] == choice.logprobs.text_offset[:tail]
    assert offsets[tail] == len(PROMPT)


async def test_a_prompt_in_the_prefix_cache_is_scored_in_full(client: Any, model: Any) -> None:
    prompt = PROMPT * 3  # several full blocks
    token_ids = list(prompt.encode())
    await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    again = await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt is cached
    scored = await client.completions.create(
        model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # computed again, every position
    check_prompt_logprobs(scored.choices[0].logprobs, token_ids, dense(model, token_ids), 1)


async def test_a_batch_of_token_id_prompts(client: Any, model: Any) -> None:
    prompts = [BYTES[:20], BYTES[5:40], [200, 201, *BYTES[:9]]]  # the last starts with bytes of no character
    reply = await client.completions.create(
        model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=3, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, token_ids in zip(reply.choices, prompts, strict=True):
        assert choice.text == bytes(token_ids).decode("utf-8", "replace")
        check_prompt_logprobs(choice.logprobs, token_ids, dense(model, token_ids), 3)


async def test_chat_prompt_logprobs_field(cluster: Cluster, model: Any) -> None:
    async with cluster.client() as http:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 2,
        }
        reply = (await http.post("/v1/chat/completions", json=body)).json()
        tokenized = (
            await http.post("/tokenize", json={"model": "tiny", "messages": body["messages"]})
        ).json()
    token_ids = tokenized["tokens"]
    check_vllm_field(reply["prompt_logprobs"], token_ids, dense(model, token_ids), 2)


async def test_refusals_name_the_field(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # vLLM's: max_tokens 0 only with echo
        await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:  # vLLM's: the field is not streamed
        await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert caught.value.body["param"] == "prompt_logprobs"


async def test_sim_engine_echoes_but_refuses_prompt_logprobs(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, engine="sim") as cluster:
        async with cluster.client() as http:
            body = {"model": "sim:tiny-test", "prompt": "hello", "echo": True, "max_tokens": 0}
            echoed = await http.post("/v1/completions", json=body)
            refused = await http.post("/v1/completions", json={**body, "logprobs": 1})
    assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"] == "hello"
    assert refused.status_code == 400 and "prompt logprobs need a model" in refused.json()["error"]["message"]
    assert isinstance(refused, httpx.Response)


async def test_a_request_rescued_after_its_first_token_keeps_its_prompt_logprobs(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=2, engine="torch", max_model_len=512) as cluster:
        client = cluster.openai(await cluster.serve())
        options: dict[str, Any] = {
            "model": "tiny",
            "prompt": PROMPT,
            "echo": True,
            "max_tokens": 60,
            "logprobs": 2,
            "temperature": 0,
        }
        try:
            reference = (await client.completions.create(**options)).choices[0]
            gateway = cluster.gateway
            assert gateway is not None
            cluster.pace.min_step_s = 0.02  # still generating when its agent dies: 60 tokens >= 1.2 s
            task = asyncio.ensure_future(client.completions.create(**options))
            for _ in range(400):
                owners = {s.owner_id for s in gateway.streams.values() if s.generated}
                if owners:
                    break
                await asyncio.sleep(0.005)
            (victim,) = owners
            (stream,) = gateway.streams.values()
            await cluster.agents[victim].kill()
            cluster.pace.release()
            rescued = (await asyncio.wait_for(task, 60)).choices[0]
        finally:
            await client.close()
    assert stream.num_rescues >= 1 and stream.owner_id != victim  # its tokens came from another agent
    assert rescued.text == reference.text
    assert rescued.logprobs.token_logprobs[: len(BYTES)] == reference.logprobs.token_logprobs[: len(BYTES)]
    assert rescued.logprobs.top_logprobs[: len(BYTES)] == reference.logprobs.top_logprobs[: len(BYTES)]
