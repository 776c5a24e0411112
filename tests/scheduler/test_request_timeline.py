"""``shoal replay --request``: one request's life, on a real cluster and on a scripted log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from agents.engines.protocol import RequestStatus
from frontend.cli import cli
from scheduler.cluster_state import live_loads
from scheduler.service import SchedulerConfig, SchedulerService
from schemas.rpc import GenerateRequest, SamplingParams
from tests.frontend.cluster import frontend_cluster
from tests.scheduler.log_helpers import write_history
from tests.scheduler.service_helpers import connected, delete_streams, new_prefix


async def _shoal(*args: str) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def _running_request(gateway: Any) -> tuple[str, str]:
    for _ in range(1000):
        for request_id, stream in list(gateway.streams.items()):
            if stream.generated and stream.owner_id:
                return request_id, stream.owner_id
        await asyncio.sleep(0.005)
    raise AssertionError("no request produced a token")


async def _every_instance_reported(service: SchedulerService, count: int) -> None:
    """Wait (bounded) until what the scheduler received holds a load report of each instance."""
    for _ in range(500):
        received, _cursor = service.follower.preview()  # folded lazily, at its next decision
        reported = [load for load in live_loads(received) if load.reported]
        if len(reported) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the scheduler saw {len(reported)} of {count} instances report")


async def _preempted_then_running_again(agent: Any, request_id: str) -> None:
    """Wait (bounded) until the engine preempted ``request_id`` and then ran a step of it again
    (its re-admission is logged after that step)."""
    resumed_at = None
    for _ in range(2000):
        stats = agent.engine.request_stats(request_id)
        assert stats is not None, "the request ended before it was preempted and ran again"
        if stats.num_preemptions >= 1 and stats.status is RequestStatus.RUNNING:
            if resumed_at is None:
                resumed_at = stats.num_tokens
            elif stats.num_tokens > resumed_at:
                await asyncio.sleep(0.05)  # the agent appends RequestAdmitted in the background
                return
        await asyncio.sleep(0.005)
    raise AssertionError("the request was not preempted, or never ran again")


async def test_timeline_of_a_request_preempted_once_and_migrated_twice(nats_url: str, tmp_path: Path) -> None:
    # 64 blocks of 4 tokens: the request and a high-priority one sent to the same instance cannot both
    # grow to their lengths, so the engine preempts the request (the lower priority) once
    engine = {"num_blocks": 64, "time_scale": 4.0}
    async with frontend_cluster(nats_url, instances=3, engine_options=engine) as cluster:
        prefix = cluster.subjects.prefix
        async with connected(nats_url, prefix) as sched_bus:
            service = SchedulerService(sched_bus, SchedulerConfig(lease_ttl_s=1.0, pairing_interval_s=3600.0))
            task = asyncio.create_task(service.run())
            try:
                await service.wait_active(10)
                await _every_instance_reported(service, len(cluster.agents))
                async with cluster.client() as client:
                    body = {
                        "model": "sim:tiny-test",
                        "prompt": "hello there",
                        "max_tokens": 240,
                        "temperature": 0,
                    }
                    call = asyncio.ensure_future(client.post("/v1/completions", json=body))
                    assert cluster.gateway is not None
                    request_id, first = await _running_request(cluster.gateway)
                    second, third = (i for i in sorted(cluster.agents) if i != first)
                    hog = GenerateRequest(
                        request_id="hog", token_ids=tuple(range(1, 61)), stream=False, priority=-1,
                        sampling=SamplingParams(max_tokens=180, ignore_eos=True),
                    )
                    assert cluster.agents[first].generate(hog).accepted
                    await _preempted_then_running_again(cluster.agents[first], request_id)
                    outcome = await cluster.agents[first].migrate(request_id, second)
                    assert outcome.migrated, outcome
                    await asyncio.sleep(0.05)
                    outcome = await cluster.agents[second].migrate(request_id, third)
                    assert outcome.migrated, outcome
                    response = await call
                    assert response.status_code == 200, response.text
                await asyncio.sleep(0.3)  # the frontend's lifecycle events are appended
            finally:
                await service.stop()
                await asyncio.wait_for(task, 10)
        path = tmp_path / "cluster.log"
        await _shoal("events", "export", "--nats", nats_url, "--prefix", prefix, "--out", str(path))
    timeline = json.loads(await _shoal("replay", "--file", str(path), "--request", request_id, "--json"))
    steps = timeline["steps"]
    kinds = [step["kind"] for step in steps]
    # the frontend appends "arrived" and the scheduler "dispatched" at the same moment, over two
    # connections: the log may hold them in either order (it failed once in CI so)
    assert sorted(kinds[:2]) == ["arrived", "dispatched"]
    # so do the frontend's "placed" (once the agent's reply is back) and the agent's "admitted"
    # (appended as it admits, before that reply): two connections again (it failed once in CI so)
    assert sorted(kinds[2:4]) == ["admitted", "placed"]
    assert kinds[4:] == ["first_token", "preempted", "admitted", "migration", "migration", "finished"]
    assert [step["seq"] for step in steps] == sorted(step["seq"] for step in steps)
    dispatched = next(step for step in steps[:2] if step["kind"] == "dispatched")
    placed = next(step for step in steps[2:4] if step["kind"] == "placed")
    admitted = next(step for step in steps[2:4] if step["kind"] == "admitted")
    first_token = steps[4]
    assert dispatched["instance_id"] == first == placed["instance_id"] == first_token["instance_id"]
    assert not placed["detail"]["bypass"] and placed["detail"]["bypass_reason"] is None
    assert admitted["instance_id"] == first and admitted["detail"]["queued_s"] >= 0
    assert not admitted["detail"]["readmission"]
    preempted, readmitted = steps[5], steps[6]
    assert preempted["instance_id"] == first and preempted["detail"]["num_blocks_freed"] > 0
    assert preempted["detail"]["num_output_tokens"] > 0
    assert readmitted["instance_id"] == first and readmitted["detail"]["readmission"]
    # it queued while the high-priority request held the blocks
    assert readmitted["time"] - preempted["time"] >= readmitted["detail"]["queued_s"] * 0.5
    candidates = dispatched["detail"]["candidates"]
    assert candidates[0]["instance_id"] == first and {c["instance_id"] for c in candidates} == set(
        cluster.agents
    )
    assert dispatched["detail"]["runner_up"] in {second, third}
    # ranked as the decision's own policy (here the paper's freeness) scored them, the chosen first
    scores = [c["score"] for c in candidates]
    assert dispatched["detail"]["policy"] == "freeness" and None not in scores
    assert scores == sorted(scores, reverse=True) == sorted((c["freeness"] for c in candidates), reverse=True)
    assert first_token["detail"]["ttft_s"] > 0
    for step, (source, destination) in zip(steps[7:9], [(first, second), (second, third)], strict=True):
        detail = step["detail"]
        assert detail["cause"]["cause"] == "requested"  # Agent.migrate, not a pairing
        assert (detail["source_id"], detail["destination_id"], detail["outcome"]) == (
            source,
            destination,
            "committed",
        )
        handshake = [h["type"] for h in detail["handshake"]]
        # in log order: each side appends its own messages, so an Ack may land before its PreAllocate
        assert {"mig_pre_allocate", "mig_ack", "mig_commit_ack"} <= set(handshake), handshake
        assert "mig_stage_done" in handshake and "mig_commit" in handshake
        assert detail["stages"] and detail["downtime_s"] is not None and detail["downtime_s"] > 0
    assert steps[-1]["detail"]["finish_reason"] == "length"
    assert [p["instance_id"] for p in timeline["preemptions"]] == [first, second, third]
    assert not any("not logged per request" in note for note in timeline["notes"])
    people = await _shoal("replay", "--file", str(path), "--request", request_id)
    assert "TTFT" in people and "runner-up" in people and f"{first} → {second}: committed" in people
    assert "preempted by recompute" in people and "again after a preemption" in people
    assert "why: requested" in people


async def test_timeline_of_a_scripted_log_and_an_unknown_request(nats_url: str, tmp_path: Path) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as bus:
            await write_history(bus)
        path = tmp_path / "log"
        await _shoal("events", "export", "--nats", nats_url, "--prefix", prefix, "--out", str(path))
        for source in (["--file", str(path)], ["--nats", nats_url, "--prefix", prefix]):
            timeline = json.loads(await _shoal("replay", *source, "--request", "r1", "--json"))
            assert [s["kind"] for s in timeline["steps"]] == [
                "arrived",
                "dispatched",
                "placed",
                "first_token",
                "migration",
                "finished",
            ]
            migration = timeline["steps"][4]["detail"]
            assert migration["downtime_s"] == 0.004 or abs(migration["downtime_s"] - 0.004) < 1e-6
        result = CliRunner().invoke(cli, ["replay", "--file", str(path), "--request", "nope"])
        assert result.exit_code == 1 and "request 'nope' is not in the log" in result.output
    finally:
        await delete_streams(nats_url, prefix)


def test_candidates_are_ranked_by_the_policy_that_chose_not_by_freeness() -> None:
    """Under blocks_ahead a request may go to an instance with less freeness (a shorter queue): the
    explanation ranks the instances by that policy's score, so the chosen one leads and the runner-up
    is the one the policy would have picked next."""
    from scheduler.replay import Candidate
    from scheduler.timeline import _dispatch_detail
    from schemas.decisions import Dispatched

    def candidate(instance_id: str, freeness: float, score: float | None) -> Candidate:
        return Candidate(
            instance_id=instance_id, num_running=1, num_waiting=0, num_used_blocks=10,
            num_total_blocks=100, freeness=freeness, freeness_after=freeness - 5, score=score,
        )

    body = Dispatched(
        epoch=1, request_id="r", instance_id="b", policy="blocks_ahead", num_prompt_tokens=64, loads=(),
    )
    view = [candidate("a", 90.0, -40.0), candidate("b", 20.0, 15.0), candidate("c", 50.0, 3.0)]
    detail = _dispatch_detail(body, view)
    assert [c["instance_id"] for c in detail["candidates"]] == ["b", "c", "a"]
    assert detail["runner_up"] == "c"  # by freeness it would have been "a"
    unscored = [candidate("a", 90.0, None), candidate("b", 20.0, None), candidate("c", 50.0, None)]
    assert _dispatch_detail(body, unscored)["runner_up"] == "a"  # a policy unknown here: by freeness
