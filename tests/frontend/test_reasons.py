"""What the frontend does with each typed reason, over real agents (sim engine) on the real nats-server.

Every way an agent can refuse a generate has one OpenAI answer (status and
``code``), decided on the ``RejectReason`` that crosses the wire; a stream the
frontend closes early tells its owner why with a ``CloseReason``, and the
lifecycle log and the metrics carry the same members.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from agents.engines.protocol import RequestRejected
from frontend.gateway import Job
from schemas import AbortRequest, CloseReason, RejectReason, RequestAborted, SamplingParams
from tests.frontend.cluster import Cluster, frontend_cluster

#: The answer the client gets for each refusal: client faults are 400s; the instance's own
#: refusals are tried elsewhere, and with no other instance the cluster is unavailable.
EXPECTED: dict[RejectReason, tuple[int, str]] = {
    RejectReason.EMPTY_PROMPT: (400, "invalid_parameter"),
    RejectReason.TOKEN_OUT_OF_RANGE: (400, "invalid_parameter"),
    RejectReason.INVALID_SAMPLING: (400, "invalid_parameter"),
    RejectReason.EXCEEDS_MODEL_CONTEXT: (400, "context_length_exceeded"),
    RejectReason.EXCEEDS_CAPACITY: (503, "service_unavailable"),
    RejectReason.TERMINATING: (503, "service_unavailable"),
    RejectReason.ABORTED: (503, "service_unavailable"),
}


def test_every_reject_reason_has_an_answer() -> None:
    assert set(EXPECTED) == set(RejectReason)


async def test_each_generate_refusal_gets_its_openai_error(nats_url: str) -> None:
    """The agent refuses (its engine raising ``RequestRejected``, or the agent itself while it
    terminates); the reason crosses the bus as a member and picks the HTTP status and code."""
    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        agent = cluster.agents["i0"]
        engine: Any = agent.engine
        body = {"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 4}
        for reason, (status, code) in EXPECTED.items():

            def refuse(request_id: str, *args: Any, _reason: RejectReason = reason, **kwargs: Any) -> bool:
                raise RequestRejected(request_id, _reason, f"the test refuses with {_reason}")

            if reason is RejectReason.TERMINATING:
                agent.terminating = True  # refused by the agent, before its engine is asked ...
                # ... once the request gets there: its load reports would tell the frontend first
                vars(agent)["load_report"] = lambda: msgspec.structs.replace(
                    type(agent).load_report(agent), terminating=False
                )
            else:
                engine.add_request = refuse
            try:
                response = await client.post("/v1/completions", json=body)
            finally:
                agent.terminating = False
                vars(agent).pop("load_report", None)
                vars(engine).pop("add_request", None)  # the engine's own method again
            assert response.status_code == status, (reason, response.text)
            error = response.json()["error"]
            assert error["code"] == code, (reason, error)
            if status == 400:
                assert f"the test refuses with {reason}" in error["message"]  # the detail, for people
            else:
                assert "Retry-After" in response.headers
            if reason is RejectReason.TERMINATING:
                # a load report sent (or still on its way) while the flag was up tells the frontend
                # the instance terminates, and it places nothing there until a later report says
                # otherwise: wait until the frontend has one built after the flag came down
                await _frontend_has_report_after(cluster, "i0", agent.load_report().seq)
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        metrics = (await client.get("/metrics")).text
        for reason in RejectReason:  # Prometheus label values are the enum values
            assert f'shoal_generate_refusals_total{{reason="{reason.value}"}} 1.0' in metrics, reason
        unplaced = len(EXPECTED)  # every refused request closed without an owner
        assert f'shoal_requests_aborted_total{{reason="unplaced"}} {float(unplaced)}' in metrics


async def _frontend_has_report_after(cluster: Cluster, instance_id: str, seq: int) -> None:
    gateway = cluster.gateway
    assert gateway is not None
    async with asyncio.timeout(10):
        while gateway.board.state.instances[instance_id].load.report_seq <= seq:
            await asyncio.sleep(0.02)


async def test_a_stream_closed_before_it_finishes_tells_its_owner_why(nats_url: str) -> None:
    """The owner receives an ``AbortRequest`` with the ``CloseReason`` member, stops the request,
    and the lifecycle log records ``RequestAborted`` with the same member."""
    async with frontend_cluster(nats_url, instances=1) as cluster:
        gateway = cluster.gateway
        assert gateway is not None
        agent = cluster.agents["i0"]
        aborts = await gateway.bus.subscribe(cluster.subjects.rpc_agent("i0", "abort"))
        job = Job(request_id="r-close", prompt_ids=(1, 2, 3, 4),
                  sampling=SamplingParams(max_tokens=200, ignore_eos=True))
        stream = await gateway.open(job)
        chunk = await stream.next_chunk()
        assert chunk is not None and chunk.token_ids and chunk.finish_reason is None
        await stream.close(CloseReason.CLIENT)
        assert stream.close_reason is CloseReason.CLIENT

        received = await asyncio.wait_for(aborts.__anext__(), 5.0)
        request = gateway.codec.decode(received.data).body
        assert request == AbortRequest(request_id="r-close", reason=CloseReason.CLIENT)
        assert isinstance(request, AbortRequest) and request.reason is CloseReason.CLIENT
        await aborts.unsubscribe()
        async with asyncio.timeout(5):
            while agent.engine.has_unfinished():  # the owner stopped it and freed its blocks
                await asyncio.sleep(0.02)

        logged: list[object] = []
        async with asyncio.timeout(5):
            while not any(isinstance(b, RequestAborted) for b in logged):
                await asyncio.sleep(0.1)  # the lifecycle log flushes in the background
                async with gateway.bus.replay(
                    cluster.subjects.events_stream, subjects=[cluster.subjects.req("r-close")]
                ) as feed:
                    logged = [gateway.codec.decode(m.data).body async for m in feed]
        aborted = [b for b in logged if isinstance(b, RequestAborted)]
        assert aborted == [RequestAborted(request_id="r-close", reason=CloseReason.CLIENT)]
        assert aborted[0].reason is CloseReason.CLIENT
        assert 'shoal_requests_aborted_total{reason="client"} 1.0' in gateway.metrics.render().decode()
