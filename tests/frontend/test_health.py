"""``/health`` is honest: 503 with a reason while no instance would take a request, 200 once one would.

Pure: the readiness of each instance on the load board (joined, ready,
silent, terminating, failed) and the body built from it. Over a real
nats-server: 503 before the first agent joins, 200 once it reports, 503
after the last agent is killed.
"""

from __future__ import annotations

import asyncio
import os

import httpx

from frontend.board import LoadBoard, Readiness
from frontend.routes.health import NO_INSTANCE_KNOWN, NO_INSTANCE_READY, health_body
from schemas import FailureReason, InstanceFailed, InstanceLeft, InstanceTerminating
from schemas.position import Position
from tests.frontend.cluster import frontend_cluster
from tests.frontend.test_board import _joined, _report


def test_an_instance_is_ready_only_once_it_reported_and_while_it_is_heard_from() -> None:
    board = LoadBoard(stale_after=3.0)
    assert health_body(board, 0.0) == (
        503, {"status": "unavailable", "reason": NO_INSTANCE_KNOWN, "instances": [], "states": {}}
    )
    board.observe(Position("ev", 1), _joined("a"), now=0.0)
    assert board.readiness("a", 0.0) is Readiness.JOINED
    assert board.choose("r", 16, now=0.0) is None  # joined is not ready: nothing would be placed
    status, body = health_body(board, 0.0)
    assert (status, body["reason"], body["states"]) == (503, NO_INSTANCE_READY, {"a": "joined"})

    board.observe(Position("loads", 1), _report("a", 1, used_blocks=0, running=0), now=1.0)
    assert board.readiness("a", 1.0) is Readiness.READY
    decision = board.choose("r", 16, now=1.0)
    assert decision is not None and decision.instance_id == "a"
    assert health_body(board, 1.0) == (200, {"status": "ok", "instances": ["a"], "states": {"a": "ready"}})

    assert board.readiness("a", 4.5) is Readiness.SILENT  # quiet for longer than stale_after
    assert health_body(board, 4.5)[0] == 503


def test_terminating_failed_and_left_instances_make_the_frontend_unavailable() -> None:
    board = LoadBoard(stale_after=3.0)
    for index, name in enumerate("abc", start=1):
        board.observe(Position("ev", index), _joined(name), now=0.0)
        board.observe(Position("loads", index), _report(name, 1, used_blocks=0, running=0), now=0.0)
    assert health_body(board, 0.5)[1]["instances"] == ["a", "b", "c"]
    board.observe(Position("ev", 4), InstanceTerminating(instance_id="a"), now=0.5)
    failed = InstanceFailed(instance_id="b", reason=FailureReason.NO_LOAD_REPORT)
    board.observe(Position("ev", 5), failed, now=0.5)
    status, body = health_body(board, 0.5)
    assert status == 200 and body["instances"] == ["c"]
    assert body["states"] == {"a": "terminating", "b": "failed", "c": "ready"}
    assert board.choose("r", 16, now=0.5) is not None
    board.observe(Position("ev", 6), InstanceLeft(instance_id="c"), now=0.6)
    status, body = health_body(board, 0.6)
    assert (status, body["status"], body["reason"]) == (503, "unavailable", NO_INSTANCE_READY)
    assert body["states"] == {"a": "terminating", "b": "failed"}
    assert board.choose("r", 16, now=0.6) is None


async def _health_until(client: httpx.AsyncClient, status: int, timeout: float = 10.0) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        reply = await client.get("/health")
        if reply.status_code == status:
            body: dict[str, object] = reply.json()
            return body
        assert loop.time() < deadline, f"/health stayed {reply.status_code}: {reply.text}"
        await asyncio.sleep(0.05)


async def test_health_is_503_before_the_first_agent_200_while_one_serves_503_after_the_last_died(
    nats_url: str,
) -> None:
    async with frontend_cluster(nats_url, instances=0) as cluster:
        client = cluster.client()
        reply = await client.get("/health")
        assert reply.status_code == 503
        assert reply.json() == {"status": "unavailable", "reason": NO_INSTANCE_KNOWN, "instances": [],
                                "states": {}, "pid": os.getpid()}

        await cluster.add_agent("i0")
        body = await _health_until(client, 200)
        assert body["instances"] == ["i0"] and body["states"] == {"i0": "ready"}
        completion = await client.post("/v1/completions", json={
            "model": "sim:tiny-test", "prompt": "hello", "max_tokens": 3})
        assert completion.status_code == 200  # ready meant a request is placed
        metrics = (await client.get("/metrics")).text
        assert 'shoal_instances{state="ready"} 1.0' in metrics

        await cluster.agents.pop("i0").kill()
        body = await _health_until(client, 503)
        assert body["reason"] == NO_INSTANCE_READY and body["instances"] == []
        assert body["states"] in ({"i0": "silent"}, {"i0": "failed"})
        metrics = (await client.get("/metrics")).text
        assert 'shoal_instances{state="ready"} 0.0' in metrics
        await client.aclose()
