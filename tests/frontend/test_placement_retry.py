"""An agent slow to answer a generate, over a real agent (sim engine) on the real nats-server.

A generate the agent does not answer in time is asked again (generate is
idempotent by request id and owner epoch), so a stall in the agent (a long
step, a loaded machine) delays the request instead of failing it; an agent
given up on is sent an abort, so a request it starts late does not run for
nobody.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from schemas import AbortReply
from tests.frontend.cluster import frontend_cluster


async def _slow_to_answer(
    agent: Any, seconds: float, times: int, aborts: list[AbortReply] | None = None
) -> list[float]:
    """Make the agent wait ``seconds`` before each of its first ``times`` generate answers, as a
    stalled agent does: its generate and abort messages are served in arrival order (one at a
    time), so an abort waits behind the generates before it. Returns the generate call times;
    ``aborts`` gets the agent's answers to aborts."""
    calls: list[float] = []
    in_order = asyncio.Lock()

    async def reserve(method: str, handler: Any) -> None:
        subject = agent.subjects.rpc_agent(agent.instance_id, method)
        service = next(s for s in agent._services if s.subject == subject)
        await service.stop()
        agent._services.remove(service)

        async def serve(data: bytes, headers: dict[str, str]) -> bytes:
            async with in_order:
                if method == "generate":
                    calls.append(time.monotonic())
                    if len(calls) <= times:
                        await asyncio.sleep(seconds)
                reply: bytes = await handler(data, headers)
                if method == "abort" and aborts is not None:
                    aborts.append(agent.codec.decode(reply).body)
                return reply

        agent._services.append(await agent.bus.serve(subject, serve))

    await reserve("generate", agent._serve_generate)
    await reserve("abort", agent._serve_abort)
    return calls


async def test_a_generate_answered_late_is_asked_again_and_the_request_served(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, generate_timeout=0.25) as cluster, \
            cluster.client() as client:
        agent = cluster.agents["i0"]
        calls = await _slow_to_answer(agent, 0.6, times=1)
        response = await client.post("/v1/completions",
                                     json={"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        assert len(calls) >= 2  # asked again while the agent was slow ...
        assert agent.num_accepted == 1  # ... and started once: the retries got its first answer
        metrics = (await client.get("/metrics")).text
        assert any(f"shoal_generate_timeouts_total {n}.0" in metrics for n in (1, 2))


async def test_an_agent_given_up_on_is_told_to_drop_the_request(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, generate_timeout=0.2, generate_retries=1) as cluster, \
            cluster.client() as client:
        agent = cluster.agents["i0"]
        engine: Any = agent.engine
        aborts: list[AbortReply] = []
        calls = await _slow_to_answer(agent, 0.3, times=2, aborts=aborts)
        response = await client.post("/v1/completions", json={
            "model": "sim:tiny-test", "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
        })
        assert response.status_code == 503, response.text
        assert "did not answer" not in response.text and "no reply" in response.json()["error"]["message"]
        async with asyncio.timeout(10):  # the agent started it late, then got the abort and dropped it
            while not aborts or engine.has_unfinished():
                await asyncio.sleep(0.02)
        assert [abort.found for abort in aborts] == [True]  # it was running there, and stopped
        assert len(calls) == 2 and agent.num_accepted == 1
        metrics = (await client.get("/metrics")).text
        assert "shoal_generate_timeouts_total 2.0" in metrics
