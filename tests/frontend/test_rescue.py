"""An agent killed mid-stream: its requests finish through rescue on another agent, text unchanged.

Also checks the request lifecycle events the frontend appends (arrived, placed,
first token, rescued, finished), which is what ``shoal replay`` shows.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas import Codec
from schemas.requests import (
    RequestAdmitted,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestPreempted,
    RequestRescued,
)
from tests.frontend.cluster import frontend_cluster

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


async def _text(client, max_tokens: int) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    stream = await client.completions.create(model="tiny", prompt=PROMPT, stream=True, temperature=0,
                                             max_tokens=max_tokens, stream_options={"include_usage": True})
    parts, usage = [], 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        parts.extend(choice.text for choice in chunk.choices)
    return "".join(parts), usage


async def test_killed_agent_requests_complete_elsewhere_with_the_same_text(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=2, engine="torch", max_model_len=512) as cluster:
        client = cluster.openai(await cluster.serve())
        try:
            reference, _ = await _text(client, 120)
            gateway = cluster.gateway
            assert gateway is not None
            cluster.pace.min_step_s = 0.02  # still running when their agent dies: 120 tokens >= 2.4 s
            tasks = [asyncio.ensure_future(_text(client, 120)) for _ in range(4)]
            for _ in range(400):
                owners = {s.owner_id for s in gateway.streams.values() if s.generated}
                if len(gateway.streams) == 4 and owners:
                    break
                await asyncio.sleep(0.005)
            victim = next(iter(owners))
            victims = [rid for rid, s in gateway.streams.items() if s.owner_id == victim]
            await cluster.agents[victim].kill()
            cluster.pace.release()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await client.close()
        assert all(text == reference and usage == 120 for text, usage in results), results
        assert victims
        await asyncio.sleep(1.0)  # lifecycle appends are asynchronous
        logged = await _lifecycle(cluster, victims[0])
        assert RequestAdmitted in logged  # by the agents (on the victim, and where it was rescued to)
        kinds = [kind for kind in logged if kind not in (RequestAdmitted, RequestPreempted)]
        assert kinds[:3] == [RequestArrived, RequestPlaced, RequestFirstToken]
        assert RequestRescued in kinds and kinds[-1] is RequestFinished


async def _lifecycle(cluster, request_id: str) -> list[type]:  # type: ignore[no-untyped-def]
    bus = cluster.buses[-1]
    codec = Codec()
    kinds: list[type] = []
    last = await bus.last_seq(cluster.subjects.events_stream)
    async with bus.replay(cluster.subjects.events_stream, until_seq=last,
                          subjects=[cluster.subjects.req(request_id)]) as feed:
        async for message in feed:
            envelope = codec.decode_or_none(message.data)
            if envelope is not None:
                kinds.append(type(envelope.body))
    return kinds


async def test_stalled_stream_is_rescued_elsewhere_with_the_same_text(nats_url: str) -> None:
    """An owner that stays alive but stops delivering a request's tokens: rescue after the stall deadline."""
    from typing import Any

    async with frontend_cluster(nats_url, instances=2, engine="torch", max_model_len=512,
                                stall_timeout=1.0) as cluster:
        client = cluster.openai(await cluster.serve())
        try:
            reference, _ = await _text(client, 60)
            muted: list[str] = []
            originals: dict[str, Any] = {}
            for instance_id, agent in cluster.agents.items():
                originals[instance_id] = agent.bus.publish

                async def mute(subject: str, data: bytes, *, headers: Any = None,
                               _original: Any = agent.bus.publish, _id: str = instance_id) -> None:
                    if (".tok." in subject or ".tokb." in subject) and (not muted or muted[0] == _id):
                        if not muted:
                            muted.append(_id)  # the first owner to publish goes silent for its requests
                        return
                    await _original(subject, data, headers=headers)

                agent.bus.publish = mute  # type: ignore[method-assign]
            try:
                text, usage = await asyncio.wait_for(_text(client, 60), 60)
            finally:
                for instance_id, agent in cluster.agents.items():
                    agent.bus.publish = originals[instance_id]  # type: ignore[method-assign]
        finally:
            await client.close()
        assert muted and text == reference and usage == 60
        assert not any(agent.engine.has_unfinished() for agent in cluster.agents.values())
