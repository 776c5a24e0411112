"""A streamed response whose only instance dies ends with ``response.failed`` (the error in its
response) within the frontend's rescue timeout, and nothing is stored. Sim agents, real NATS."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.frontend.cluster import frontend_cluster

HANG_S = 30.0


async def test_a_stream_whose_only_instance_dies_ends_with_response_failed(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, rescue_timeout=1.0) as cluster:
        client = cluster.openai(await cluster.serve())
        cluster.pace.min_step_s = 0.05  # 200 tokens last 10 s: it is running when its agent dies
        events: list[Any] = []

        async def read() -> None:
            stream = await client.responses.create(
                model="sim:tiny-test", input="hi", max_output_tokens=200, temperature=0, stream=True
            )
            async for event in stream:
                events.append(event)

        reading = asyncio.ensure_future(read())
        for _ in range(1000):
            if sum(event.type == "response.output_text.delta" for event in events) >= 3:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"fewer than 3 deltas in 10 s: {[event.type for event in events]}")
        (agent,) = cluster.agents.values()
        await agent.kill()
        await asyncio.wait_for(reading, HANG_S)
        last = events[-1]
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error.code == "service_unavailable"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(last.response.id)
        await client.close()
