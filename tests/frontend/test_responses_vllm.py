"""The Responses API on a vllm-engine agent (a random Llama checkpoint with a Hermes chat template,
real NATS, one process), with the official ``openai`` client: a plain response equals chat's
answer, a stream's deltas join to the same text, a required function call validates (vLLM's own
structured outputs), and its result continues the conversation through ``previous_response_id``.
Skipped (with the reason) where vLLM is not installed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from agents.engines.vllm_engine import vllm_unavailable_reason
from tests.frontend.cluster import Cluster, frontend_cluster
from tests.frontend.tool_checkpoint import build_tool_checkpoint

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,  # vLLM's engine starts processes of its own
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
    ),
]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


def _compact(model: str) -> dict[str, int]:
    """logit_bias -100 on the checkpoint's whitespace-only and control-character tokens: vLLM's
    xgrammar backend allows whitespace between JSON tokens, which a random model repeats."""
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    special = {tokenizer.token_to_id(token) for token in ("<s>", "</s>", "<pad>")}
    texts = {i: tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size()) if i not in special}
    return {str(i): -100 for i, text in texts.items() if text.strip() == "" or any(ord(c) < 32 for c in text)}


@pytest.fixture(scope="module")
async def cluster(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    model = str(build_tool_checkpoint(tmp_path_factory.mktemp("tools")))
    async with frontend_cluster(
        nats_url,
        instances=1,
        engine="vllm",
        engine_options={"model": model, "max_model_len": 2048, "num_blocks": 256},
        max_model_len=2048,
        tool_call_parser="hermes",
    ) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running
        for agent in running.agents.values():
            agent.engine.shutdown()


async def test_responses_on_the_vllm_engine(cluster: Cluster) -> None:
    client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    model = cluster.config.model_name
    try:
        plain = await client.responses.create(model=model, input="hi", max_output_tokens=12, temperature=0)
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0
        )
        assert plain.output_text == chat.choices[0].message.content
        assert plain.usage.input_tokens == chat.usage.prompt_tokens
        stream = await client.responses.create(
            model=model, input="hi", max_output_tokens=12, temperature=0, stream=True
        )
        events = [event async for event in stream]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == events[-1].response.output_text == plain.output_text
        assert [e.sequence_number for e in events] == list(range(len(events)))

        call_turn = await client.responses.create(
            model=model,
            input="weather in Paris?",
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=300,
            temperature=0,
            extra_body={"logit_bias": _compact(cluster.config.model)},
        )
        calls = [item for item in call_turn.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        answer = await client.responses.create(
            model=model,
            previous_response_id=call_turn.id,
            tools=[TOOL],
            tool_choice="none",
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C"}],
            max_output_tokens=8,
            temperature=0,
        )
        assert answer.output[0].type == "message"
        assert answer.usage.input_tokens > call_turn.usage.input_tokens + call_turn.usage.output_tokens
    finally:
        await client.close()
