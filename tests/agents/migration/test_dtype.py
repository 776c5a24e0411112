"""The torch engine in another dtype (``shoal agent --dtype``): float32 unchanged, bfloat16 migrates.

``--dtype float32`` (or ``auto``) gives exactly the default engine's greedy
tokens; a bfloat16 engine says so in its model identity and KV layout, and a
request moves live between two bfloat16 agents with the tokens of an unmigrated
bfloat16 run; a bfloat16 agent refuses to migrate to a float32 one (and the
``migrate_out`` command naming it), saying the dtypes differ, and the scheduler
never pairs the two.
"""

from __future__ import annotations

from typing import Any

from agents.agent import FaultPlan, StepPace
from agents.cli import build_engine
from agents.engines.torch_engine import TorchEngine
from scheduler.policy import compatibility_key
from schemas import AbortRequest, CommandRejectReason, GenerateRequest, MigrateOut, SamplingParams
from schemas.instance import InstanceJoined
from schemas.reasons import MigrationAbortReason
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, unmigrated_tokens

PROMPT = tuple((i * 37) % 300 + 1 for i in range(70))
SAMPLING = greedy(120)


def _cli_engine(dtype: str | None) -> Any:
    return build_engine(
        "torch", model="tiny", profile="", num_blocks=48, kv_cache_bytes=None, block_size=None,
        max_batch_size=8, max_model_len=None, seed=0, device="cpu", time_scale=1.0, dtype=dtype,
    )


def _engine(dtype: str) -> TorchEngine:
    return TorchEngine("tiny", num_blocks=48, batch_invariant=True, dtype=dtype)


def test_float32_gives_the_default_tokens_and_bfloat16_says_what_it_is() -> None:
    default = unmigrated_tokens(_cli_engine(None), PROMPT, greedy(40))
    assert unmigrated_tokens(_cli_engine("float32"), PROMPT, greedy(40)) == default
    assert unmigrated_tokens(_cli_engine("auto"), PROMPT, greedy(40)) == default
    assert _cli_engine(None).info.model.dtype == "float32"
    half = _cli_engine("bfloat16")
    assert half.info.model.dtype == half.info.kv_layout.dtype == "bfloat16"
    assert half.info.bytes_per_block * 2 == _cli_engine("float32").info.bytes_per_block
    assert len(unmigrated_tokens(half, PROMPT, greedy(40))) == 40


async def test_a_request_migrates_between_two_bfloat16_agents(nats_url: str) -> None:
    expected = unmigrated_tokens(_engine("bfloat16"), PROMPT, SAMPLING, "moving")
    pace = StepPace(0.02)  # the source until the outcome: the 102 tokens left last >= 2 s
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(_engine("bfloat16"), fast_agent_config("h1", faults=FaultPlan(pace=pace)))
        a2 = await cluster.add(_engine("bfloat16"), fast_agent_config("h2"))
        watcher = await cluster.watch("moving")
        request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING)
        assert (await cluster.generate("h1", request)).accepted
        await watcher.wait_tokens(18)
        outcome = await a1.migrate("moving", "h2")
        pace.release()
        assert outcome.migrated, (outcome.reason, outcome.detail)
        await watcher.wait_finished(timeout=30)
        assert watcher.tokens() == expected
        assert {d.owner_epoch for d in watcher.deltas} == {0, 1}
        await watcher.close()
        assert a2.transport.stats().transfers_received == outcome.num_stages


async def test_a_bfloat16_agent_refuses_a_float32_destination(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        half = await cluster.add(_engine("bfloat16"), fast_agent_config("h1"))
        await cluster.add(_engine("float32"), fast_agent_config("f1"))
        watcher = await cluster.watch("stays")
        request = GenerateRequest(
            request_id="stays", token_ids=PROMPT, sampling=SamplingParams(max_tokens=400, ignore_eos=True)
        )
        assert (await cluster.generate("h1", request)).accepted
        await watcher.wait_tokens(1)
        outcome = await half.migrate("stays", "f1")
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.INCOMPATIBLE
        assert "dtype differs: bfloat16 here, float32 on 'f1'" in outcome.detail
        command = MigrateOut(epoch=1, destination_id="f1", target_freeness=99)
        reply = await cluster.call("h1", "migrate_out", command)
        assert not reply.accepted and reply.reason is CommandRejectReason.INCOMPATIBLE
        assert "dtype differs" in reply.detail
        await cluster.call("h1", "abort", AbortRequest(request_id="stays"))
        await watcher.close()


def test_the_scheduler_never_pairs_two_dtypes() -> None:
    joined = {
        dtype: InstanceJoined(
            instance_id=dtype, num_blocks=48, block_size=16, model=engine.info.model,
            kv_layout=engine.info.kv_layout, transport_address="tcp://127.0.0.1:1", transport_kind="tcp",
            engine="torch",
        )
        for dtype, engine in (("bfloat16", _engine("bfloat16")), ("float32", _engine("float32")))
    }
    assert compatibility_key(joined["bfloat16"]) != compatibility_key(joined["float32"])


def test_shoal_up_gives_every_torch_agent_its_dtype_and_engine_core() -> None:
    from bus.cli_config import to_argv
    from bus.options import NatsOptions
    from frontend.up import UpConfig, agent_config

    args = to_argv(agent_config(UpConfig(dtype="bfloat16"), NatsOptions(), "agent-0"))
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in to_argv(agent_config(UpConfig(), NatsOptions(), "agent-0"))
    assert "--engine-core" not in args  # the default
    args = to_argv(agent_config(UpConfig(engine_core="process"), NatsOptions(), "agent-0"))
    assert args[args.index("--engine-core") + 1] == "process"
