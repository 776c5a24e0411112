"""A request never waits forever: one whose instance dies with no other to take it fails within
the frontend's rescue timeout (``--rescue-timeout``), as a 503 or, once streaming, an SSE error
event then ``[DONE]``; counted in ``shoal_requests_aborted_total{reason="no_instance"}`` and logged
as ``RequestAborted(reason=NO_INSTANCE)``. A request on an instance that is only busy waits and
completes; a new request when no instance is ready gets 503 with ``Retry-After`` at once.

Agents (sim engine), the gateway and the app run in this process on the real nats-server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from schemas import Codec
from schemas.reasons import CloseReason
from schemas.requests import RequestAborted
from tests.frontend.cluster import Cluster, frontend_cluster

PROMPT = "The quick brown fox"
#: far longer than any wait below needs: a request still running at this bound hangs
HANG_S = 30.0


def _body(stream: bool, max_tokens: int) -> dict[str, Any]:
    return {"model": "sim:tiny-test", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


async def _running_owner(cluster: Cluster, polls: int = 1000) -> str:
    """The instance of the one request in flight, once it has generated a token (polls x 10 ms)."""
    gateway = cluster.gateway
    assert gateway is not None
    for _ in range(polls):
        streams = [s for s in gateway.streams.values() if s.generated and s.owner_id]
        if streams:
            owner = streams[0].owner_id
            assert owner is not None
            return owner
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request generated a token within {polls * 0.01:.0f} s")


async def _aborted(cluster: Cluster, polls: int = 300) -> list[RequestAborted]:
    """The ``RequestAborted`` events in the log, once there is one (lifecycle appends are asynchronous)."""
    bus = cluster.buses[-1]
    codec = Codec()
    for _ in range(polls):
        found: list[RequestAborted] = []
        last = await bus.last_seq(cluster.subjects.events_stream)
        async with bus.replay(cluster.subjects.events_stream, until_seq=last,
                              subjects=[f"{cluster.subjects.prefix}.ev.req.*"]) as feed:
            async for message in feed:
                envelope = codec.decode_or_none(message.data)
                if envelope is not None and isinstance(envelope.body, RequestAborted):
                    found.append(envelope.body)
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no RequestAborted in the log within {polls * 0.02:.0f} s")


async def _metric(http: httpx.AsyncClient, name: str, reason: str) -> float:
    text = (await http.get("/metrics")).text
    line = f'{name}{{reason="{reason}"}} '
    values = [float(row[len(line):]) for row in text.splitlines() if row.startswith(line)]
    return values[0] if values else 0.0


def _assert_unavailable(body: dict[str, Any], rescue: bool) -> None:
    error = body["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "service_unavailable", body
    assert ("rescue timeout" in error["message"]) is rescue, error["message"]


async def test_a_streamed_request_whose_only_instance_dies_ends_with_an_error_event_then_done(
    nats_url: str,
) -> None:
    async with frontend_cluster(nats_url, instances=1, rescue_timeout=1.0) as cluster:
        url = await cluster.serve()
        cluster.pace.min_step_s = 0.05  # 200 tokens last 10 s: it is running when its agent dies
        async with httpx.AsyncClient(base_url=url, timeout=HANG_S) as http:
            payloads: list[str] = []

            async def read() -> None:
                async with http.stream("POST", "/v1/completions", json=_body(True, 200)) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            payloads.append(line[len("data: "):])

            reading = asyncio.ensure_future(read())
            owner = await _running_owner(cluster)
            for _ in range(1000):  # the client has had some tokens: streaming has begun
                if len(payloads) >= 3:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"fewer than 3 SSE events in 10 s: {payloads}")
            await cluster.agents[owner].kill()
            try:
                await asyncio.wait_for(reading, HANG_S)
            except TimeoutError:
                raise AssertionError(f"the stream still hangs {HANG_S:.0f} s after its only agent died "
                                     f"(rescue timeout 1 s); last events: {payloads[-3:]}") from None
            assert payloads[-1] == "[DONE]", payloads[-3:]
            chunks = [json.loads(p) for p in payloads[:-2]]
            assert len(chunks) >= 3 and all("choices" in chunk for chunk in chunks), payloads[:-2]
            _assert_unavailable(json.loads(payloads[-2]), rescue=True)
            assert await _metric(http, "shoal_requests_aborted_total", "no_instance") == 1.0
        aborted = await _aborted(cluster)
        assert [event.reason for event in aborted] == [CloseReason.NO_INSTANCE]


async def test_a_request_whose_only_instance_dies_gets_a_503_json_error(nats_url: str) -> None:
    async with frontend_cluster(nats_url, instances=1, rescue_timeout=1.0) as cluster:
        cluster.pace.min_step_s = 0.05
        async with cluster.client() as http:
            posting = asyncio.ensure_future(http.post("/v1/completions", json=_body(False, 200)))
            owner = await _running_owner(cluster)
            await cluster.agents[owner].kill()
            try:
                response = await asyncio.wait_for(posting, HANG_S)
            except TimeoutError:
                raise AssertionError(f"the request still hangs {HANG_S:.0f} s after its only agent died "
                                     "(rescue timeout 1 s)") from None
            assert response.status_code == 503, response.text
            assert response.headers.get("retry-after") == str(cluster.config.retry_after_s)
            _assert_unavailable(response.json(), rescue=True)
            assert await _metric(http, "shoal_requests_aborted_total", "no_instance") == 1.0
        aborted = await _aborted(cluster)
        assert [event.reason for event in aborted] == [CloseReason.NO_INSTANCE]


async def test_requests_on_a_busy_instance_wait_past_the_rescue_timeout_and_complete(nats_url: str) -> None:
    """One instance with room for about one request at a time: the others wait in its queue for
    longer than the rescue timeout, and every one completes."""
    async with frontend_cluster(nats_url, instances=1, engine_options={"num_blocks": 12},
                                rescue_timeout=0.2) as cluster:
        gateway = cluster.gateway
        assert gateway is not None
        cluster.pace.min_step_s = 0.03  # 30 tokens last 0.9 s: a request queued behind one waits longer
        most_waiting = 0

        async def watch() -> None:
            nonlocal most_waiting
            while True:
                for load in gateway.board.loads(gateway.clock()):
                    most_waiting = max(most_waiting, load.num_waiting)
                await asyncio.sleep(0.01)

        watching = asyncio.ensure_future(watch())
        try:
            async with cluster.client() as http:
                responses = await asyncio.wait_for(
                    asyncio.gather(*(http.post("/v1/completions", json=_body(False, 30)) for _ in range(3))),
                    HANG_S,
                )
        finally:
            watching.cancel()
        assert most_waiting >= 1, "no request waited: the instance was never busy"
        assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
        assert all(r.json()["usage"]["completion_tokens"] == 30 for r in responses)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_new_request_when_no_instance_is_ready_gets_503_with_retry_after_at_once(
    nats_url: str, stream: bool,
) -> None:
    """At once: the rescue timeout (60 s) is far past the bounded wait, so waiting for it fails."""
    async with frontend_cluster(nats_url, instances=1, rescue_timeout=60.0) as cluster:
        gateway = cluster.gateway
        assert gateway is not None
        await cluster.agents["i0"].kill()
        for _ in range(500):
            if not gateway.board.ready_instance_ids(gateway.clock()):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the killed agent still counts as ready after 5 s")
        async with cluster.client() as http:
            try:
                response = await asyncio.wait_for(http.post("/v1/completions", json=_body(stream, 20)), 10.0)
            except TimeoutError:
                raise AssertionError("a new request with no instance ready waited instead of a 503") from None
            assert response.status_code == 503, response.text
            assert response.headers.get("retry-after") == str(cluster.config.retry_after_s)
            _assert_unavailable(response.json(), rescue=False)
            assert await _metric(http, "shoal_requests_aborted_total", "unplaced") == 1.0
            assert await _metric(http, "shoal_requests_aborted_total", "no_instance") == 0.0
        aborted = await _aborted(cluster)
        assert [event.reason for event in aborted] == [CloseReason.UNPLACED]


async def test_a_request_whose_instance_comes_back_within_the_rescue_timeout_completes_there(
    nats_url: str,
) -> None:
    """An agent restarted under its own id (as ``shoal up`` restarts one) takes its request back."""
    async with frontend_cluster(nats_url, instances=1, rescue_timeout=HANG_S,
                                stall_timeout=4 * HANG_S) as cluster:
        gateway = cluster.gateway
        assert gateway is not None
        cluster.pace.min_step_s = 0.02
        async with cluster.client() as http:
            posting = asyncio.ensure_future(http.post("/v1/completions", json=_body(False, 100)))
            owner = await _running_owner(cluster)
            stream = next(iter(gateway.streams.values()))
            await cluster.agents[owner].kill()
            for _ in range(1000):
                if stream.unplaced_since is not None:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("no rescue found the instance gone within 10 s")
            await cluster.add_agent(owner)
            try:
                response = await asyncio.wait_for(posting, HANG_S + 10)
            except TimeoutError:
                raise AssertionError("the request still hangs after its instance came back") from None
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 100
            assert stream.num_rescues == 1 and stream.owner_id == owner
