"""Live migration between two torch-engine agents on a real nats-server, over TCP and over UCX.

The migrated request must produce exactly the tokens of an unmigrated run, and
a subscriber to its token subject must see no gap and no duplicate across the
move. Other requests decode on both instances meanwhile. Engines run in
batch-invariant mode, so a request's tokens do not depend on its batch-mates.
The source is paced (``StepPace``) until the migration's outcome, so the request
cannot finish before it moves however fast the engine is.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from agents.agent import FaultPlan, StepPace
from agents.engines.torch_engine import TorchEngine
from schemas import GenerateRequest, SamplingParams
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, unmigrated_tokens
from transport import TransportConfig
from transport.ucx import ucx_available

SAMPLING = SamplingParams(max_tokens=300, temperature=1.0, seed=7, ignore_eos=True)
PROMPT = tuple((i * 37) % 300 + 1 for i in range(70))
#: the source's slowest pace until the outcome: the 290 tokens left after the migration starts last >= 2.9 s
PACE_S = 0.01


def _engine(core: str = "thread") -> TorchEngine:
    return TorchEngine("tiny", num_blocks=48, batch_invariant=True, core=core)


def _reference_tokens() -> list[int]:
    return unmigrated_tokens(_engine(), PROMPT, SAMPLING, "moving")


@pytest.mark.parametrize(
    ("kind", "secure", "core"),
    [("tcp", False, "thread"), ("ucx", False, "thread"), ("tcp", True, "thread"), ("tcp", False, "process")],
)
async def test_migrated_request_matches_an_unmigrated_run(
    request: pytest.FixtureRequest, nats_url: str, kind: str, secure: bool, core: str
) -> None:
    """``secure``: on ``shoal up --secure``'s server, each agent its own NATS user, mutual TLS.
    ``core="process"``: each engine's model step in a child process (the agents publish while it
    computes, and copy KV from and into the pools they share with it)."""
    if kind == "ucx" and (reason := ucx_available()) is not None:
        pytest.fail(f"UCX must be exercised here but is unavailable: {reason}")
    transport = TransportConfig(kind=kind, ucx_tls="tcp" if kind == "ucx" else "", send_timeout_s=5.0)
    expected = _reference_tokens()
    secure_nats = request.getfixturevalue("secure_nats") if secure else None
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url, secure_nats) as cluster:
        a1 = await cluster.add(
            _engine(core), replace(fast_agent_config("t1", faults=FaultPlan(pace=pace)), transport=transport)
        )
        a2 = await cluster.add(_engine(core), replace(fast_agent_config("t2"), transport=transport))
        assert a1.transport.kind == kind
        for instance, name in (("t1", "bg1"), ("t2", "bg2")):  # co-located requests on both sides
            background = GenerateRequest(
                request_id=name, token_ids=(3, 4, 5), sampling=SamplingParams(max_tokens=60)
            )
            assert (await cluster.generate(instance, background)).accepted
        free_before = a2.engine.stats().num_free_blocks + sum(
            r.num_blocks for r in a2.engine.stats().requests if r.request_id == "bg2"
        )
        watcher = await cluster.watch("moving")
        request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING)
        assert (await cluster.generate("t1", request)).accepted
        await watcher.wait_tokens(18)  # 88 tokens: 5 full blocks and a partial one, however slow the engine
        outcome = await a1.migrate("moving", "t2")
        pace.release()
        assert outcome.migrated, outcome.reason
        assert outcome.num_stages >= 2
        await watcher.wait_finished(timeout=60)
        assert watcher.tokens() == expected
        assert {d.owner_epoch for d in watcher.deltas} == {0, 1}
        await watcher.close()
        async with asyncio.timeout(30):
            while a1.engine.has_unfinished() or a2.engine.has_unfinished():
                await asyncio.sleep(0.01)
        assert a1.engine.stats().num_free_blocks == 48
        assert a2.engine.stats().num_free_blocks == 48 >= free_before
        assert a1.transport.stats().transfers_sent == outcome.num_stages
        assert a2.transport.stats().transfers_received == outcome.num_stages
