"""``/tokenize`` and ``/detokenize`` count and decode exactly as the generation routes do."""

from __future__ import annotations

from tests.frontend.cluster import frontend_cluster

MODEL = "sim:tiny-test"


async def test_tokenize_counts_what_a_completion_and_a_chat_are_charged(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        prompt = "Hello, wörld"
        counted = await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
        assert counted.status_code == 200, counted.text
        body = counted.json()
        completion = await client.post("/v1/completions",
                                       json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert body["count"] == len(body["tokens"]) == completion.json()["usage"]["prompt_tokens"]
        models = (await client.get("/v1/models")).json()
        assert body["max_model_len"] == models["data"][0]["max_model_len"] == 256
        assert body["token_strs"] is None

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
        chat_count = (await client.post("/tokenize", json={"messages": messages})).json()["count"]
        chat = await client.post("/v1/chat/completions",
                                 json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert chat_count == chat.json()["usage"]["prompt_tokens"]
        without_prompt = await client.post("/tokenize",
                                           json={"messages": messages, "add_generation_prompt": False})
        assert without_prompt.json()["count"] < chat_count


async def test_detokenize_gives_back_the_text_and_token_strs_spell_it(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        text = "tokens, 東京 🙂"
        counted = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                        "return_token_strs": True})).json()
        assert len(counted["token_strs"]) == counted["count"]
        back = await client.post("/detokenize", json={"model": MODEL, "tokens": counted["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}


async def test_bad_tokenize_requests_get_openai_errors(nats_url: str) -> None:
    async with (
        frontend_cluster(nats_url, instances=1, api_keys=("k",)) as cluster,
        cluster.client() as client,
    ):
        auth = {"Authorization": "Bearer k"}
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 401
        unknown = await client.post("/tokenize", json={"model": "gpt-9", "prompt": "hi"}, headers=auth)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        neither = await client.post("/tokenize", json={"model": MODEL}, headers=auth)
        assert neither.status_code == 400 and neither.json()["error"]["type"] == "invalid_request_error"
        out_of_vocab = await client.post("/detokenize", json={"tokens": [1, 10**6]}, headers=auth)
        assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["param"] == "tokens"
        negative = await client.post("/detokenize", json={"tokens": [-1]}, headers=auth)
        assert negative.status_code == 400
        assert (await client.post("/detokenize", json={"tokens": []}, headers=auth)).json() == {"prompt": ""}
