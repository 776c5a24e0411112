"""One trace per request, end to end, as a real OTLP receiver gets it.

A real cluster on the real nats-server — the frontend app, the scheduler
service and two sim agents, each with its own tracer provider built by
:mod:`bus.telemetry` from ``OTEL_*`` variables pointing at a receiver
(:class:`bus.otlp_receiver.OtlpReceiver`) on a thread of this test — exports
over OTLP http/protobuf; the receiver decodes each ``ExportTraceServiceRequest``
with OTLP's own protobuf messages. A request
that is live-migrated mid-decode arrives as one trace holding the frontend's,
the scheduler's and both agents' spans with the right parents; a request
without migration is one trace from the HTTP span to the last token. Last,
``shoal up --otlp-endpoint`` (the entry points as users start them) puts every
process's spans into the trace of a caller's ``traceparent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider

from agents.agent import Agent
from bus import JetStreamBus
from bus.otlp_receiver import OtlpReceiver, ReceivedSpan
from bus.server import free_port
from bus.telemetry import TelemetryConfig, tracer_provider
from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.gateway import Gateway
from scheduler.service import SchedulerConfig, SchedulerService
from schemas import Subjects
from tests.frontend.cluster import agent_config, bus_config, make_engine

pytestmark = pytest.mark.slow


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[ReceivedSpan]]]:
    with OtlpReceiver(keep_spans=True) as receiver:
        yield receiver.url, receiver.spans


@dataclass
class TracedCluster:
    gateway: Gateway
    app: Any
    agents: dict[str, Agent]
    providers: list[TracerProvider] = field(default_factory=list)

    async def flush(self) -> None:
        for provider in self.providers:
            await asyncio.to_thread(provider.force_flush)


@contextlib.asynccontextmanager
async def traced_cluster(nats_url: str, otlp_url: str) -> AsyncIterator[TracedCluster]:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_url, "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"
    }
    telemetry = TelemetryConfig.from_env(environ)
    subjects = Subjects(f"t{uuid.uuid4().hex[:12]}")
    providers: list[TracerProvider] = []
    buses: list[JetStreamBus] = []

    def provider(name: str, instance_id: str | None = None) -> TracerProvider:
        built = tracer_provider(telemetry, name, instance_id=instance_id)
        assert built is not None
        providers.append(built)
        return built

    async def bus(name: str) -> JetStreamBus:
        connected = JetStreamBus(bus_config(nats_url, subjects, name))
        await connected.connect()
        buses.append(connected)
        return connected

    agents: dict[str, Agent] = {}
    scheduler: SchedulerService | None = None
    scheduler_task: asyncio.Task[None] | None = None
    gateway: Gateway | None = None
    try:
        for instance_id in ("i0", "i1"):
            agent = Agent(
                make_engine("sim", time_scale=4.0), await bus(instance_id), agent_config(instance_id),
                tracer_provider=provider("shoal-agent", instance_id),
            )
            await agent.start()
            agents[instance_id] = agent
        scheduler = SchedulerService(
            await bus("scheduler"),
            SchedulerConfig(lease_ttl_s=1.0, pairing_interval_s=0.1, failure_timeout_s=5.0),
            tracer_provider=provider("shoal-scheduler"),
        )
        scheduler_task = asyncio.create_task(scheduler.run())
        await scheduler.wait_active(10)
        config = FrontendConfig(
            nats_url=nats_url, prefix=subjects.prefix, model="sim:tiny-test", max_model_len=256,
            instance_stale_after=2.0, gap_grace=0.1, dispatch_timeout=2.0,
        )
        gateway = Gateway(await bus("frontend"), config)
        await gateway.start()
        app = create_app(config, gateway=gateway, tracer_provider=provider("shoal-frontend"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (len(gateway.board.ready_instance_ids(gateway.clock())) < 2
               or len(scheduler.view().instances) < 2):
            assert loop.time() < deadline, "instances not visible"
            await asyncio.sleep(0.05)
        yield TracedCluster(gateway, app, agents, providers)
    finally:
        if gateway is not None:
            await gateway.stop()
        if scheduler is not None:
            await scheduler.stop()
        if scheduler_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(scheduler_task, 10)
        for agent in agents.values():
            with contextlib.suppress(Exception):
                await agent.stop()
        for provider_ in providers:
            provider_.shutdown()
        cleaner_config = dataclasses.replace(bus_config(nats_url, subjects, "cleaner"), provision=False)
        cleaner = JetStreamBus(cleaner_config)
        await cleaner.connect()
        for stream in (subjects.events_stream, subjects.loads_stream, f"KV_{subjects.kv_bucket}"):
            with contextlib.suppress(Exception):
                await cleaner.client.jsm().delete_stream(stream)
        await cleaner.close()
        for connected in buses:
            with contextlib.suppress(Exception):
                await connected.close()


def _complete(app: Any, max_tokens: int) -> Any:
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://shoal", timeout=60.0)

    async def run() -> httpx.Response:
        async with client:
            return await client.post("/v1/completions", json={
                "model": "sim:tiny-test", "prompt": "hello there, general kenobi", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True,
            })

    return asyncio.ensure_future(run())


def _one_trace(spans: list[ReceivedSpan], request_id: str) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    of_request = [s for s in spans if s.attributes.get("shoal.request.id") == request_id]
    roots = [s for s in of_request if s.service == "shoal-frontend"]
    assert len(roots) == 1, roots
    root = roots[0]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    ids = {s.span_id for s in trace}
    assert root.parent_id == ""  # no caller traceparent: the HTTP span is the root
    assert all(s.parent_id in ids for s in trace if s is not root), "a span's parent is not in the trace"
    assert all(s.trace_id == root.trace_id for s in of_request)
    return root, trace


def _only(trace: list[ReceivedSpan], **match: Any) -> ReceivedSpan:
    found = [s for s in trace if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


async def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline
        await asyncio.sleep(0.02)


async def test_a_migrated_request_is_one_trace_across_frontend_scheduler_and_both_agents(
    nats_url: str, otlp_receiver: tuple[str, list[ReceivedSpan]]
) -> None:
    otlp_url, spans = otlp_receiver
    async with traced_cluster(nats_url, otlp_url) as cluster:
        gateway = cluster.gateway
        response = _complete(cluster.app, max_tokens=120)
        await _wait_for(lambda: any(s.first_token_at is not None for s in gateway.streams.values()))
        (stream,) = gateway.streams.values()
        request_id, source_id = stream.request_id, stream.owner_id
        assert source_id is not None
        destination_id = "i1" if source_id == "i0" else "i0"
        outcome = await cluster.agents[source_id].migrate(request_id, destination_id)
        assert outcome.migrated, outcome
        assert (await response).status_code == 200
        await asyncio.sleep(0.2)  # the agents' last spans end after the final delta
        await cluster.flush()

    root, trace = _one_trace(spans, request_id)
    assert {s.service for s in trace} == {
        "shoal-frontend", "shoal-scheduler", f"shoal-agent/{source_id}", f"shoal-agent/{destination_id}"
    }
    assert root.name == "POST /v1/completions" and root.attributes["shoal.placement.bypass"] is False
    dispatch = _only(trace, name="dispatch")
    assert dispatch.parent_id == root.span_id
    assert dispatch.attributes["shoal.dispatch.instance"] == source_id
    assert "shoal.dispatch.freeness" in dispatch.attributes and "shoal.dispatch.policy" in dispatch.attributes
    source = _only(trace, name="generate", service=f"shoal-agent/{source_id}")
    assert source.parent_id == root.span_id and source.attributes["shoal.moved_away"] is True
    assert "first_token" in source.events
    migration = _only(trace, name="migration")
    assert migration.parent_id == source.span_id and migration.service == f"shoal-agent/{source_id}"
    stages = [s for s in trace if s.name == "migration.stage"]
    assert stages and all(s.parent_id == migration.span_id for s in stages)
    arrived = _only(trace, name="migration.destination")
    assert arrived.parent_id == migration.span_id and arrived.service == f"shoal-agent/{destination_id}"
    resumed = _only(trace, name="generate", service=f"shoal-agent/{destination_id}")
    assert resumed.parent_id == arrived.span_id
    assert resumed.attributes["shoal.migrated_from"] == source_id and "finish" in resumed.events
    assert root.end_ns >= resumed.end_ns  # the HTTP span lasts until the last token


async def test_a_request_without_migration_is_one_trace_from_http_to_last_token(
    nats_url: str, otlp_receiver: tuple[str, list[ReceivedSpan]]
) -> None:
    otlp_url, spans = otlp_receiver
    async with traced_cluster(nats_url, otlp_url) as cluster:
        response = await _complete(cluster.app, max_tokens=8)
        assert response.status_code == 200
        await asyncio.sleep(0.2)
        await cluster.flush()
    (root,) = [s for s in spans if s.service == "shoal-frontend"]
    root, trace = _one_trace(spans, root.attributes["shoal.request.id"])
    assert {s.service for s in trace} >= {"shoal-frontend", "shoal-scheduler"}
    generate = _only(trace, name="generate")
    assert generate.parent_id == root.span_id
    assert {"first_token", "finish"} <= set(generate.events)
    assert generate.attributes["shoal.finish_reason"] == "length"
    children = {s.name: s for s in trace if s.parent_id == generate.span_id}
    assert set(children) == {"queue", "prefill", "decode"}
    assert children["queue"].end_ns <= children["prefill"].start_ns + 1
    assert children["prefill"].end_ns <= children["decode"].start_ns + 1
    assert _only(trace, name="dispatch").parent_id == root.span_id
    assert root.start_ns <= generate.start_ns and generate.end_ns <= root.end_ns
    assert not [s for s in trace if s.name.startswith("migration")]


async def test_shoal_up_with_otlp_endpoint_exports_each_processs_spans_into_the_callers_trace(
    otlp_receiver: tuple[str, list[ReceivedSpan]], tmp_path: Path
) -> None:
    """The entry points as users run them: ``shoal up --otlp-endpoint`` and real HTTP with a traceparent."""
    otlp_url, spans = otlp_receiver
    port = free_port()
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}  # the SDK's own variable: export soon
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "sim",
         "--instances", "2", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
         "--otlp-endpoint", otlp_url, "--ready-timeout", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    assert process.stdout is not None
    try:
        lines: list[str] = []
        while not any(line.startswith("shoal is serving") for line in lines):
            line = await asyncio.to_thread(process.stdout.readline)
            assert line, "shoal up exited:\n" + "\n".join(lines)
            lines.append(line.rstrip())
        caller_trace = uuid.uuid4().hex
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 6, "stream": True},
                headers={"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"},
            )
        assert response.status_code == 200
    finally:
        process.send_signal(signal.SIGINT)  # each child's provider flushes as it stops
        await asyncio.to_thread(process.wait, 60)
        process.stdout.close()
    mine = [s for s in spans if s.trace_id == caller_trace]
    services = {s.service for s in mine}
    assert any(s.startswith("shoal-scheduler/") for s in services), services
    assert any(s.startswith("shoal-agent/agent-") for s in services), services
    (root,) = [s for s in mine if s.service == "shoal-frontend"]
    assert root.parent_id == "00f067aa0ba902b7"
    expected = {"POST /v1/completions", "dispatch", "generate", "queue", "prefill", "decode"}
    assert {s.name for s in mine} >= expected
