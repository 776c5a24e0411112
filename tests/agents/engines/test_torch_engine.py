"""TorchEngine end to end on the tiny preset: migration of KV blocks, preemption, bad input, stop rules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from agents.engines import engine_class
from agents.engines.protocol import (
    Engine,
    FinishReason,
    KVBuffer,
    MigrationError,
    PreemptionEvent,
    RejectReason,
    RequestRejected,
)
from agents.engines.torch_engine import TorchEngine
from schemas import SamplingParams
from tests.agents.engines.loop_ticks import loop_ticks

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=100, seed=1234)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def _drain(
    engine: TorchEngine, outputs: dict[str, list[int]], finish: dict[str, FinishReason] | None = None
) -> None:
    """Step until idle, collecting each request's tokens (checking they arrive in order)."""
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens = outputs.setdefault(out.request_id, [])
            assert out.first_index == len(tokens)
            tokens.extend(out.token_ids)
            if finish is not None and out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason


def _alone(
    prompt: list[int], sampling: SamplingParams, request_id: str = "solo", **options: object
) -> list[int]:
    engine = TorchEngine("tiny", **{"num_blocks": 32, "batch_invariant": True, **options})
    engine.add_request(request_id, prompt, sampling)
    outputs: dict[str, list[int]] = {}
    _drain(engine, outputs)
    return outputs[request_id]


def test_engine_satisfies_the_protocol_and_is_registered() -> None:
    engine = TorchEngine("tiny", num_blocks=8)
    assert isinstance(engine, Engine)
    assert engine_class("torch") is TorchEngine
    assert engine.info.bytes_per_block == 2 * 2 * 2 * 16 * 16 * 4
    assert engine.info.kv_layout.block_size == 16 and engine.info.eos_token_id == 257
    assert TorchEngine("tiny", kv_cache_bytes=10 * 8192 + 100).info.num_blocks == 10  # a memory budget
    with pytest.raises(ValueError, match=r"neither a preset"):
        TorchEngine("no-such-model")


@pytest.mark.parametrize(
    ("sampling", "core"),
    [(GREEDY, "thread"), (SEEDED, "thread"), (SEEDED, "process")],
    ids=["greedy", "seeded", "seeded-core-process"],
)
def test_migrated_request_decodes_exactly_as_without_the_move(sampling: SamplingParams, core: str) -> None:
    """``core="process"``: both engines compute in child processes; export and import go through the
    KV pool they share with this process."""
    prompt = _prompt(21)
    reference = _alone(prompt, sampling, request_id="moving")

    source = TorchEngine("tiny", num_blocks=32, batch_invariant=True, core=core)
    destination = TorchEngine("tiny", num_blocks=32, batch_invariant=True, core=core)
    source.add_request("moving", prompt, sampling)
    source.add_request("stays", _prompt(9, 1), sampling)
    destination.add_request("resident", _prompt(40, 2), SEEDED)  # holds the low block ids there
    outputs: dict[str, list[int]] = {}

    def step(engine: TorchEngine) -> None:
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.token_ids)

    for _ in range(6):
        step(source)
        step(destination)
    # Stage 0: copy the blocks that exist now while the request keeps decoding.
    table = source.block_ids("moving")
    stage0 = source.export_blocks("moving", range(len(table) - 1))
    reservation0 = destination.reserve(stage0.num_blocks)
    destination.import_blocks(reservation0.block_ids, KVBuffer(stage0.num_blocks, stage0.nbytes,
                                                               bytes(stage0.payload)))
    for _ in range(8):
        step(source)
        step(destination)
    # Last stage: suspend, copy the rest, commit.
    source.suspend("moving")
    step(source)
    table = source.block_ids("moving")
    rest = source.export_blocks("moving", range(stage0.num_blocks, len(table)))
    reservation1 = destination.reserve(rest.num_blocks)
    destination.import_blocks(reservation1.block_ids, rest)
    generated = source.output_token_ids("moving")
    destination.admit_migrated("moving", prompt, generated, sampling, 0, [reservation0, reservation1])
    assert source.release_request("moving") == len(table)
    assert destination.block_ids("moving") != table  # it landed at other block ids
    _drain(source, outputs)
    _drain(destination, outputs)

    assert outputs["moving"] == reference
    assert len(outputs["moving"]) == sampling.max_tokens
    assert outputs["stays"] == _alone(_prompt(9, 1), sampling, request_id="stays")
    assert outputs["resident"] == _alone(_prompt(40, 2), SEEDED, request_id="resident")
    assert destination.stats().num_free_blocks == 32 and source.stats().num_free_blocks == 32


@pytest.mark.parametrize("core", ["thread", "process"])
def test_logprobs_are_the_sampled_tokens_under_the_model_for_the_requests_that_ask(core: str) -> None:
    import torch

    from agents.engines.torch_engine.config import preset
    from agents.engines.torch_engine.model import build_random_model

    engine = TorchEngine("tiny", num_blocks=32, batch_invariant=True, core=core)
    asks = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3, temperature=0.8,
                          seed=3)
    engine.add_request("asks", _prompt(13), asks)
    engine.add_request("quiet", _prompt(9, 1), GREEDY)
    tokens: dict[str, list[int]] = {}
    logprobs: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.request_id == "asks":
                assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
                assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
                logprobs.extend(out.logprobs)
                top.extend(out.top_logprobs)
            else:
                assert out.logprobs is None and out.top_logprobs is None  # not asked: not computed
    model = build_random_model(preset("tiny"), seed=0, dtype=torch.float32, device="cpu")
    sequence = _prompt(13) + tokens["asks"]
    with torch.inference_mode():
        dense = model.dense_logits(torch.tensor(sequence)).log_softmax(-1)
    expected = [dense[13 - 1 + i, token].item() for i, token in enumerate(tokens["asks"])]
    assert logprobs == pytest.approx(expected, abs=1e-4)
    for i, alternatives in enumerate(top):  # the 3 most likely under the model, most likely first
        best = dense[13 - 1 + i].topk(3)
        assert [t for t, _ in alternatives] == best.indices.tolist()
        assert [v for _, v in alternatives] == pytest.approx(best.values.tolist(), abs=1e-4)
    engine.close()


def test_import_refuses_unreserved_blocks_and_buffers_without_kv() -> None:
    source = TorchEngine("tiny", num_blocks=8)
    destination = TorchEngine("tiny", num_blocks=8)
    source.add_request("r", _prompt(20), GREEDY)
    source.step()
    buffer = source.export_blocks("r", [0, 1])
    with pytest.raises(MigrationError, match="not reserved"):
        destination.import_blocks([0, 1], buffer)
    reservation = destination.reserve(2)
    with pytest.raises(MigrationError, match="no KV data"):
        destination.import_blocks(reservation.block_ids, KVBuffer(2, buffer.nbytes, b"\x00" * 16))
    with pytest.raises(MigrationError, match="cannot export"):
        source.export_blocks("r", [5])
    assert destination.release_reservation(reservation) == 2


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_small_pool_preempts_and_every_request_still_gets_the_same_tokens(batch_invariant: bool) -> None:
    # Batch-invariant recompute is bit-exact, so sampling matches too; the fast path relies on greedy margins.
    if batch_invariant:
        sampling = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=9)
    else:
        sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": _prompt(12 + 3 * i, i) for i in range(4)}

    def run(num_blocks: int) -> tuple[dict[str, list[int]], TorchEngine]:
        engine = TorchEngine("tiny", num_blocks=num_blocks, batch_invariant=batch_invariant)
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, sampling)
        outputs: dict[str, list[int]] = {}
        _drain(engine, outputs)
        return outputs, engine

    unconstrained, _ = run(64)
    constrained, engine = run(7)  # four requests need 12 blocks at their longest
    events = engine.take_events()
    assert engine.stats().num_preemptions > 0
    assert any(isinstance(event, PreemptionEvent) for event in events)
    assert constrained == unconstrained
    assert all(len(tokens) == 30 for tokens in constrained.values())


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(batch_invariant: bool) -> None:
    """A long prompt prefilled in chunks beside running decodes: the same tokens, no early token."""
    sampling = (
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
        if batch_invariant  # bit-exact, so even sampling matches; the fast path relies on greedy margins
        else SamplingParams(max_tokens=12, ignore_eos=True)
    )
    long_prompt = _prompt(90 if batch_invariant else 300, 7)

    def run(max_step_tokens: int | None) -> tuple[dict[str, list[int]], int]:
        engine = TorchEngine(
            "tiny", num_blocks=64, batch_invariant=batch_invariant, max_step_tokens=max_step_tokens
        )
        engine.add_request("short", _prompt(5), sampling)
        engine.step()
        engine.add_request("long", long_prompt, sampling)
        outputs: dict[str, list[int]] = {"short": [engine.output_token_ids("short")[0]]}
        steps_before_first = 0
        while engine.has_unfinished():
            result = engine.step()
            if "long" not in outputs:
                steps_before_first += 1
                assert result.num_prefill_tokens + result.num_decode_requests <= (max_step_tokens or 10**6)
            for out in result.outputs:
                tokens = outputs.setdefault(out.request_id, [])
                assert out.first_index == len(tokens)
                tokens.extend(out.token_ids)
        return outputs, steps_before_first

    whole, whole_steps = run(None)
    chunked, chunked_steps = run(32)
    assert whole_steps == 1
    assert chunked_steps == -(-len(long_prompt) // 31)  # 31 prompt tokens beside the one decode per step
    assert chunked == whole
    assert all(len(tokens) == 12 for tokens in chunked.values())


def test_a_request_in_its_chunked_prefill_is_not_migratable_until_it_decodes() -> None:
    engine = TorchEngine("tiny", num_blocks=64, max_step_tokens=16, batch_invariant=True)
    engine.add_request("long", _prompt(40), GREEDY)
    engine.step()
    assert engine.migration_blocker("long") == "its prompt is still being prefilled"
    while not engine.output_token_ids("long"):
        engine.step()
    assert engine.migration_blocker("long") is None


def test_bad_requests_are_rejected_clearly_and_others_are_unaffected() -> None:
    engine = TorchEngine("tiny", num_blocks=32, max_model_len=64, batch_invariant=True)
    engine.add_request("good-1", _prompt(10), SEEDED)
    bad = {
        "too-long": (_prompt(65), GREEDY, RejectReason.EXCEEDS_MODEL_CONTEXT),
        "empty": ([], GREEDY, RejectReason.EMPTY_PROMPT),
        "token-too-big": ([1, 2, 320], GREEDY, RejectReason.TOKEN_OUT_OF_RANGE),
        "token-negative": ([1, -1], GREEDY, RejectReason.TOKEN_OUT_OF_RANGE),
        "negative-max-tokens": ([1, 2], SamplingParams(max_tokens=-1), RejectReason.INVALID_SAMPLING),
        "bad-top-p": ([1, 2], SamplingParams(top_p=1.5), RejectReason.INVALID_SAMPLING),
    }
    for request_id, (prompt, sampling, reason) in bad.items():
        with pytest.raises(RequestRejected) as caught:
            engine.add_request(request_id, prompt, sampling)
        assert caught.value.reason is reason and request_id in str(caught.value)
    engine.add_request("good-2", _prompt(7, 3), GREEDY)
    outputs: dict[str, list[int]] = {}
    _drain(engine, outputs)
    assert set(outputs) == {"good-1", "good-2"}
    assert outputs["good-1"] == _alone(_prompt(10), SEEDED, request_id="good-1")
    assert outputs["good-2"] == _alone(_prompt(7, 3), GREEDY, request_id="good-2")
    assert engine.stats().num_rejections == len(bad)
    assert len(engine.take_events()) == len(bad)
    assert engine.add_request("good-1", [1], GREEDY) is True  # finished ids may be reused


def test_stop_token_min_tokens_and_max_tokens() -> None:
    prompt = _prompt(15)
    free_run = _alone(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    stop_id = free_run[3]
    first = free_run.index(stop_id)
    engine = TorchEngine("tiny", num_blocks=32, batch_invariant=True)
    stopping = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,))
    engine.add_request("stop", prompt, stopping)
    engine.add_request("min", prompt, SamplingParams(max_tokens=20, min_tokens=8, stop_token_ids=(stop_id,)))
    engine.add_request("short", prompt, SamplingParams(max_tokens=2))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    _drain(engine, outputs, finish)
    assert outputs["stop"] == free_run[: first + 1] and finish["stop"] is FinishReason.STOP
    assert stop_id not in outputs["min"][:8] and len(outputs["min"]) >= 8
    assert outputs["short"] == free_run[:2] and finish["short"] is FinishReason.LENGTH


def test_checkpoint_with_several_eos_ids_stops_on_any_unless_ignore_eos(tmp_path: Path) -> None:
    reference = TorchEngine("tiny", num_blocks=16)
    prompt = _prompt(12)
    free_run = _alone(prompt, SamplingParams(max_tokens=12, ignore_eos=True), batch_invariant=False)
    second_eos = free_run[4]
    first_eos = next(t for t in range(256, 320) if t not in free_run)
    weights = {k: v.contiguous() for k, v in reference.model.state_dict().items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    config = reference.model_config
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "eos_token_id": [first_eos, second_eos], "torch_dtype": "float32",
    }))
    engine = TorchEngine(str(tmp_path), num_blocks=16)
    engine.add_request("eos", prompt, SamplingParams(max_tokens=12))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    _drain(engine, outputs, finish)
    assert outputs["ignore"] == free_run
    assert outputs["eos"] == free_run[: free_run.index(second_eos) + 1] and finish["eos"] is FinishReason.STOP


async def test_abort_during_an_async_step_drops_the_request_and_frees_its_blocks() -> None:
    engine = TorchEngine("tiny", num_blocks=16)
    engine.add_request("keep", _prompt(30), GREEDY)
    engine.add_request("drop", _prompt(30, 1), GREEDY)
    task = asyncio.create_task(engine.step_async())
    await asyncio.sleep(0)  # the step is now computing in its worker thread
    assert engine.abort("drop") is True
    assert engine.abort("drop") is False
    result = await task
    assert [out.request_id for out in result.outputs] == ["keep"]
    assert engine.request_stats("drop") is None
    assert engine.stats().num_free_blocks == 16 - 2
    assert await engine.run_until_idle() == GREEDY.max_tokens - 1
    assert engine.stats().num_free_blocks == 16


async def test_exclusive_steps_compute_inline_when_short_and_in_a_thread_otherwise() -> None:
    """A short step of an exclusive caller runs on its loop (no hand-off); others leave the loop free."""
    engine = TorchEngine("tiny", num_blocks=32, inline_step_max_s=1.0)
    reference = TorchEngine("tiny", num_blocks=32)
    for e in (engine, reference):
        e.add_request("a", _prompt(20), GREEDY)
        e.add_request("b", _prompt(20, 1), GREEDY)
    async with loop_ticks() as ticks:

        async def step(**kwargs: bool) -> tuple[list[tuple[str, tuple[int, ...]]], bool]:
            """The step's outputs, and whether other coroutines ran while it computed."""
            ticks.reset()
            result = await engine.step_async(**kwargs)
            return [(o.request_id, o.token_ids) for o in result.outputs], ticks.count > 0

        first, loop_ran_first = await step(exclusive=True)  # nothing measured yet: a thread
        second, loop_ran_second = await step(exclusive=True)  # a short decode step: inline
        third, loop_ran_third = await step()  # not exclusive: always a thread
    assert (loop_ran_first, loop_ran_second, loop_ran_third) == (True, False, True)
    expected = [[(o.request_id, o.token_ids) for o in reference.step().outputs] for _ in range(3)]
    assert [first, second, third] == expected  # the same tokens whichever way a step ran


@pytest.mark.parametrize("max_step_tokens", [None, 64])
def test_shoal_agent_builds_the_torch_engine_with_its_step_budget(max_step_tokens: int | None) -> None:
    from agents.cli import build_engine

    engine = build_engine(
        "torch", model="tiny", profile="tiny-test", num_blocks=32, kv_cache_bytes=None, block_size=16,
        max_batch_size=8, max_model_len=None, seed=0, device="cpu", time_scale=1.0,
        max_step_tokens=max_step_tokens,
    )
    engine.add_request("long", _prompt(200), GREEDY)
    engine.step()
    computed = engine.scheduler.request("long").num_computed_tokens
    assert computed == (200 if max_step_tokens is None else 64)  # whole prompt, or one 64-token chunk
