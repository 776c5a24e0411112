"""The HTTP API over real agents (sim engine) on the real nats-server: happy paths and the bad-input table."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.frontend.cluster import frontend_cluster


async def test_completion_streams_and_counts_usage(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=2) as cluster, cluster.client() as client:
        body = {"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 7, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"

        plain = await client.post("/v1/completions", json={**body, "stream": False})
        assert plain.status_code == 200
        assert plain.json()["usage"]["completion_tokens"] == 7
        metrics = (await client.get("/metrics")).text
        assert "shoal_bypass_placements_total 2.0" in metrics  # no scheduler runs in this test
        assert 'shoal_instance_freeness{instance="i0"}' in metrics
        health = (await client.get("/health")).json()
        assert health["instances"] == ["i0", "i1"]


_CHAT = {"messages": [{"role": "user", "content": "x"}]}
_REFUSED = ("use_beam_search",)
#: bad values of supported options: a 400 naming the field
_NAMED = {"tools": "tools", "bad schema": "response_format", "bad regex": "structured_outputs.regex",
          "two constraints": "guided_choice", "logit_bias past the vocabulary": "logit_bias",
          "min_p > 1": "min_p"}
BAD_INPUTS = [
    ("malformed json", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("json array", "/v1/completions", b"[1, 2]", 400, "invalid_parameter"),
    ("missing prompt", "/v1/completions", {"model": "sim:tiny-test"}, 400, "invalid_parameter"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
    ("negative max_tokens", "/v1/completions", {"model": "sim:tiny-test", "prompt": "x", "max_tokens": -1},
     400, "invalid_parameter"),
    ("temperature too high", "/v1/completions",
     {"model": "sim:tiny-test", "prompt": "x", "temperature": 5}, 400, "invalid_parameter"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"model": "sim:tiny-test", **_CHAT,
                                                                "top_logprobs": 2}, 400, "invalid_parameter"),
    ("best_of > 1", "/v1/completions", {"model": "sim:tiny-test", "prompt": "x", "best_of": 2}, 400,
     "invalid_parameter"),
    ("n past its range", "/v1/completions", {"model": "sim:tiny-test", "prompt": "x", "n": 129}, 400,
     "invalid_parameter"),
    ("context overflow", "/v1/completions",
     {"model": "sim:tiny-test", "prompt": "x" * 300, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("max_tokens past context", "/v1/completions",
     {"model": "sim:tiny-test", "prompt": "x", "max_tokens": 1000}, 400, "context_length_exceeded"),
    ("token id out of range", "/v1/completions",
     {"model": "sim:tiny-test", "prompt": [1, 99999]}, 400, "invalid_parameter"),
    ("empty prompt", "/v1/completions", {"model": "sim:tiny-test", "prompt": ""}, 400, "invalid_parameter"),
    ("an empty prompt in a list", "/v1/completions", {"model": "sim:tiny-test", "prompt": ["a", ""]}, 400,
     "invalid_parameter"),
    ("empty messages", "/v1/chat/completions", {"model": "sim:tiny-test", "messages": []}, 400,
     "invalid_parameter"),
    ("bad role", "/v1/chat/completions",
     {"model": "sim:tiny-test", "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_parameter"),
    ("image part", "/v1/chat/completions",
     {"model": "sim:tiny-test", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "invalid_parameter"),
    ("too many stops", "/v1/completions",
     {"model": "sim:tiny-test", "prompt": "x", "stop": [str(i) for i in range(40)]}, 400,
     "invalid_parameter"),
    ("bad priority header", "/v1/completions", {"model": "sim:tiny-test", "prompt": "x"}, 400,
     "invalid_parameter"),
    # JSON may carry a lone surrogate; no tokenizer can take it (it crashed the byte tokenizer before).
    ("lone surrogate in prompt", "/v1/completions", b'{"model": "sim:tiny-test", "prompt": "a\\ud800b"}', 400,
     "invalid_parameter"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"model": "sim:tiny-test", "messages": [{"role": "user", "content": "x\\udfff"}]}', 400,
     "invalid_parameter"),
    ("unknown route", "/v1/nothing", {"model": "sim:tiny-test"}, 404, "not_found"),
    # options that would change the answer are refused by name, never silently ignored
    *[(name, path, {"model": "sim:tiny-test", **body}, 400, "invalid_parameter") for name, path, body in [
        ("tools", "/v1/chat/completions", {**_CHAT, "tools": [{"type": "function", "function": {}}]}),
        ("use_beam_search", "/v1/completions", {"prompt": "x", "use_beam_search": True}),
        ("bad schema", "/v1/chat/completions", {**_CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}),
        ("bad regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a(b"}}),
        ("two constraints", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                                                "guided_choice": ["a", "b"]}),
        ("logit_bias past the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}),
        ("min_p > 1", "/v1/completions", {"prompt": "x", "min_p": 1.5}),
    ]],
]


async def test_bad_inputs_get_openai_errors_with_the_right_status(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, max_request_bytes=100_000) as cluster, \
            cluster.client() as client:
        for name, path, body, status, code in BAD_INPUTS:
            headers = {"x-shoal-priority": "high"} if name == "bad priority header" else {}
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(path, content=content,
                                         headers={"content-type": "application/json", **headers})
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["code"] == code, (name, error)
            if name in _REFUSED:
                assert error["param"] == name and "not supported" in error["message"], error
            if name in _NAMED:
                assert error["param"] == _NAMED[name], error
        big = await client.post("/v1/completions", content=b"x" * 200_000,
                                headers={"content-type": "application/json"})
        assert big.status_code == 413
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status_code == 405


async def test_models_are_listed_and_retrieved_by_name_and_an_unknown_one_is_a_404(nats_url: str) -> None:
    aliases = ("meta-llama/Llama-3.1-8B",)  # a Hugging Face id: a name with a slash
    async with frontend_cluster(nats_url, instances=1, extra_model_names=aliases) as cluster:
        client = cluster.openai(await cluster.serve())
        try:
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["sim:tiny-test", *aliases]
            for name in ("sim:tiny-test", *aliases):
                card = await client.models.retrieve(name)
                assert (card.id, card.object, card.owned_by) == (name, "model", "shoal")
                assert card.model_extra["max_model_len"] == 256
            import openai

            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("gpt-9")
            assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
        finally:
            await client.close()


@pytest.mark.parametrize("keys", [("secret",)])
async def test_api_keys_are_enforced(nats_url: str, keys: tuple[str, ...]) -> None:
    async with frontend_cluster(nats_url, instances=1, api_keys=keys) as cluster, cluster.client() as client:
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        denied = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert denied.json()["error"]["code"] == "invalid_api_key"
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200
        for path in ("/v1/models", "/v1/models/sim:tiny-test"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers={"Authorization": "Bearer secret"})).status_code == 200


async def test_overload_answers_429_with_retry_after_and_no_instance_answers_503(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, max_concurrent_requests=1) as cluster:
        url = await cluster.serve()
        client = httpx.AsyncClient(base_url=url, timeout=30.0)
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            second = await client.post("/v1/completions", json={**body, "stream": False})
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
        # more choices than the server ever takes at once: a 400 that says so (a retry would not help)
        two = await client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False, "n": 2})
        assert two.status_code == 400 and "at most 1 at once" in two.json()["error"]["message"]
        for agent in list(cluster.agents.values()):
            await agent.stop()
        cluster.agents.clear()
        await _until_no_instances(cluster)
        refused = await client.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        await client.aclose()


async def test_n_choices_take_n_slots_and_a_refused_one_lets_the_placed_ones_go(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, max_concurrent_requests=2) as cluster:
        url = await cluster.serve()
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                two = await client.post("/v1/completions", json={**body, "stream": False, "n": 2})
                assert two.status_code == 429  # the first choice got the last slot, the second none
                gateway = cluster.gateway
                assert gateway is not None
                for _ in range(100):
                    if len(gateway.streams) == 1:
                        break
                    await asyncio.sleep(0.05)
                assert len(gateway.streams) == 1  # the placed choice was let go: only `first` runs
            both = {**body, "max_tokens": 2, "stream": False, "n": 2}
            one = await client.post("/v1/completions", json=both)
            assert one.status_code == 200 and len(one.json()["choices"]) == 2


async def test_the_prompts_of_one_request_are_placed_at_once(nats_url: str) -> None:
    """A batch of prompts (an evaluation harness sends 32 at a time) is dispatched together, so the
    engine's first step can hold all of them, not one dispatch round trip after another."""
    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        gateway = cluster.gateway
        assert gateway is not None
        opened, in_flight, most = gateway.open, [0], [0]

        async def slow_open(job: Any) -> Any:  # a dispatch round trip of 50 ms
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                await asyncio.sleep(0.05)
                return await opened(job)
            finally:
                in_flight[0] -= 1

        gateway.open = slow_open  # type: ignore[method-assign]
        body = {"model": "sim:tiny-test", "prompt": ["a", "b", "c", "d"], "max_tokens": 2, "n": 2}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert [choice["index"] for choice in response.json()["choices"]] == list(range(8))
        assert most[0] == 8


async def _until_no_instances(cluster: object) -> None:
    gateway = cluster.gateway  # type: ignore[attr-defined]
    for _ in range(100):
        if not gateway.board.live_instance_ids(gateway.clock()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("instances still visible")


async def test_benchmark_extensions_are_accepted_and_priority_reaches_the_log(nats_url: str) -> None:
    """vLLM's extensions (ignore_eos, top_k, min_tokens, repetition_penalty) and shoal's priority."""
    from schemas import Codec
    from schemas.requests import RequestArrived

    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "top_k": 5,
                "min_tokens": 2, "repetition_penalty": 1.1, "top_p": 0.9, "seed": 3, "temperature": 0.7}
        by_body = await client.post("/v1/completions", json={**body, "priority": -1})
        by_header = await client.post("/v1/completions", json=body, headers={"X-Shoal-Priority": "5"})
        assert by_body.status_code == 200 and by_header.status_code == 200
        no_logprobs = await client.post("/v1/completions", json={**body, "logprobs": 1})
        assert no_logprobs.status_code == 200
        assert no_logprobs.json()["choices"][0]["logprobs"] is None  # sim gives none: none made up
        ids = [by_body.json()["id"], by_header.json()["id"]]
        bus, codec, priorities = cluster.buses[-1], Codec(), {}
        for _ in range(40):
            last = await bus.last_seq(cluster.subjects.events_stream)
            async with bus.replay(cluster.subjects.events_stream, until_seq=last,
                                  subjects=[cluster.subjects.req(i) for i in ids]) as feed:
                async for message in feed:
                    envelope = codec.decode_or_none(message.data)
                    if envelope is not None and isinstance(envelope.body, RequestArrived):
                        priorities[envelope.body.request_id] = envelope.body.priority
            if len(priorities) == 2:
                break
            await asyncio.sleep(0.1)
        assert priorities == {ids[0]: -1, ids[1]: 5}


async def test_request_deadline_ends_a_long_request_early(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, request_deadline=0.1) as cluster, \
            cluster.client() as client:
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 250, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200
        data = response.json()
        assert data["choices"][0]["finish_reason"] == "length"
        assert 0 < data["usage"]["completion_tokens"] < 250
        gateway = cluster.gateway
        assert gateway is not None
        for _ in range(100):  # the request was aborted on the agent, its blocks freed
            if not cluster.agents["i0"].engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert not cluster.agents["i0"].engine.has_unfinished()


async def test_hung_scheduler_means_bypass_until_it_answers_again(nats_url: str) -> None:
    """A scheduler that does not answer costs one dispatch timeout, then bypass; when it answers, normal."""
    from schemas import Codec, DispatchReply, DispatchRequest

    changes = {"dispatch_timeout": 0.3, "scheduler_backoff": 2.0}
    async with frontend_cluster(nats_url, instances=2, **changes) as cluster, cluster.client() as client:
        gateway = cluster.gateway
        assert gateway is not None
        hung = asyncio.Event()
        hung.set()
        codec = Codec()
        asked_while_hung: list[bytes] = []

        async def dispatch(data: bytes, headers: dict[str, str]) -> bytes:
            if hung.is_set():
                asked_while_hung.append(data)
                await asyncio.sleep(0.6)  # longer than the frontend waits
            ask = codec.decode(data).body
            assert isinstance(ask, DispatchRequest)
            return codec.encode(DispatchReply(request_id=ask.request_id, instance_id="i1", epoch=1), time=0.0)

        service = await gateway.bus.serve(cluster.subjects.rpc_dispatch, dispatch)
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 2}
        for _ in range(4):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert len(asked_while_hung) == 1  # one timeout, then bypass for the backoff: not four
        assert gateway.num_scheduler_placements == 0
        hung.clear()
        await asyncio.sleep(2.1)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert gateway.num_scheduler_placements == 1
        await service.stop()


async def test_metrics_export_each_instance_s_preemptions_from_its_load_reports(nats_url: str) -> None:
    """An instance short of KV blocks preempts; /metrics shows the count its agent reported."""
    async with frontend_cluster(nats_url, instances=0) as cluster:
        agent = await cluster.add_agent("small", num_blocks=8)  # 32 tokens of KV for 4 requests of 24
        await cluster.wait_instances(1)
        async with cluster.client() as client:
            body = {"model": "sim:tiny-test", "prompt": "x" * 8, "max_tokens": 16, "ignore_eos": True}
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(4))
            )
            assert [r.status_code for r in replies] == [200] * 4
            assert [r.json()["usage"]["completion_tokens"] for r in replies] == [16] * 4
            preempted = agent.engine.stats().num_preemptions
            assert preempted > 0
            line = f'shoal_instance_preemptions_total{{instance="small"}} {float(preempted)}'
            deadline = asyncio.get_running_loop().time() + 5.0
            metrics = ""
            while line not in metrics and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)  # the next load report carries the count
                metrics = (await client.get("/metrics")).text
            assert line in metrics
