"""Test helpers: agents (sim, torch or vllm engines) and a frontend in one process on the real nats-server.

:func:`frontend_cluster` starts ``n`` real :class:`agents.agent.Agent` s under a
prefix unique to the test, a :class:`~frontend.gateway.Gateway` on its own bus
connection, and the FastAPI app; ``client()`` gives an ``httpx.AsyncClient``
talking to the app in process and ``openai()`` the official ``openai`` client
on top of it. Every agent shares ``cluster.pace`` (a :class:`~agents.agent.StepPace`,
released: the engines' own speed); a test sets ``cluster.pace.min_step_s`` while it
acts on a running request, so the request cannot finish first however fast the
engine is. Streams are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from agents.agent import Agent, AgentConfig, FaultPlan, StepPace
from bus import BusConfig, JetStreamBus, NatsAuth, StreamConfig
from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.gateway import Gateway
from schemas import Subjects
from transport import TransportConfig

__all__ = ["Cluster", "bus_config", "disconnect_after_first_text", "frontend_cluster", "make_engine"]


def bus_config(url: str, subjects: Subjects, name: str, auth: NatsAuth | None = None) -> BusConfig:
    return BusConfig(
        url=url, subjects=subjects, name=name, auth=auth or NatsAuth(),
        streams=StreamConfig(events_max_age=3600.0, loads_max_age=3600.0, loads_max_msgs_per_subject=100),
        ack_timeout=0.5, append_timeout=10.0, heartbeat=0.5, reconnect_time_wait=0.05, api_timeout=3.0,
    )


def make_engine(kind: str, **options: Any) -> Any:
    if kind == "vllm":  # options["model"]: a checkpoint folder (agents.engines.vllm_engine.checkpoint)
        from agents.engines.vllm_engine.engine import VllmEngine

        return VllmEngine(options["model"], num_blocks=options.get("num_blocks", 128), max_batch_size=32,
                          kv_cache_bytes=64 * 2**20, max_model_len=options.get("max_model_len", 512),
                          dtype="float32")
    if kind == "sim":
        from agents.engines.sim import SimEngine

        return SimEngine("tiny-test", num_blocks=options.get("num_blocks", 256), max_batch_size=16,
                         time_scale=options.get("time_scale", 1.0))
    from agents.engines.torch_engine import TorchEngine

    # options["model"]: a preset or a checkpoint folder (the frontend loads the same tokenizer)
    return TorchEngine(options.get("model", "tiny"), num_blocks=options.get("num_blocks", 128),
                       max_batch_size=32, max_model_len=options.get("max_model_len", 512))


def agent_config(instance_id: str, pace: StepPace | None = None) -> AgentConfig:
    return AgentConfig(
        instance_id=instance_id, report_interval_s=0.05, heartbeat_interval_s=0.3, tick_interval_s=0.02,
        transport=TransportConfig(kind="tcp"), faults=FaultPlan(pace=pace),
    )


@dataclass
class Cluster:
    url: str
    subjects: Subjects
    config: FrontendConfig
    engine: str
    agents: dict[str, Agent] = field(default_factory=dict)
    gateway: Gateway | None = None
    app: Any = None
    buses: list[JetStreamBus] = field(default_factory=list)
    server: Any = None
    server_task: Any = None
    #: a ``SecureNats`` (tests/conftest.py): every component on its own NATS user, mutual TLS
    secure: Any = None
    #: every agent's slowest pace (0: released)
    pace: StepPace = field(default_factory=lambda: StepPace(0.0))

    def auth(self, user: str) -> NatsAuth | None:
        return self.secure.auth(user) if self.secure is not None else None

    async def add_agent(self, instance_id: str, **engine_options: Any) -> Agent:
        bus = JetStreamBus(bus_config(self.url, self.subjects, instance_id, self.auth(instance_id)))
        await bus.connect()
        self.buses.append(bus)
        agent = Agent(make_engine(self.engine, **engine_options), bus, agent_config(instance_id, self.pace))
        await agent.start()
        self.agents[instance_id] = agent
        return agent

    async def wait_instances(self, count: int, timeout: float = 10.0) -> None:
        assert self.gateway is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.gateway.board.ready_instance_ids(self.gateway.clock())) < count:
            if loop.time() > deadline:
                raise TimeoutError(f"fewer than {count} instances visible to the frontend")
            await asyncio.sleep(0.05)

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """A client of the app in process (responses are buffered whole: no streaming timing)."""
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://shoal", timeout=60.0, **kwargs)

    async def serve(self) -> str:
        """Serve the app over real HTTP (uvicorn, in this loop); returns the base URL."""
        import uvicorn

        from bus.server import free_port

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, lifespan="off",
                                               log_level="warning"))
        self.server = server
        self.server_task = asyncio.ensure_future(server.serve())
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    assert not self.server_task.done(), "the frontend's HTTP server stopped before it started"
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError("the frontend's HTTP server did not start within 30 s") from None
        return f"http://127.0.0.1:{port}"

    def openai(self, base_url: str) -> Any:
        import openai

        return openai.AsyncOpenAI(api_key="none", base_url=f"{base_url}/v1", max_retries=0, timeout=60.0)


@contextlib.asynccontextmanager
async def frontend_cluster(
    url: str, *, instances: int = 2, engine: str = "sim", engine_options: dict[str, Any] | None = None,
    secure: Any = None, **config_changes: Any,
) -> AsyncIterator[Cluster]:
    """``secure``: a ``SecureNats`` to run on (its prefix and users; streams purged, not deleted, after)."""
    subjects = Subjects(f"t{uuid.uuid4().hex[:12]}") if secure is None else secure.subjects
    url = url if secure is None else secure.url
    model = {"sim": "sim:tiny-test"}.get(engine, (engine_options or {}).get("model", "tiny"))
    config = FrontendConfig(nats_url=url, prefix=subjects.prefix, model=model, max_model_len=256,
                            instance_stale_after=1.0, gap_grace=0.1)
    config = dataclasses.replace(config, **config_changes)
    cluster = Cluster(url=url, subjects=subjects, config=config, engine=engine, secure=secure)
    try:
        for index in range(instances):
            await cluster.add_agent(f"i{index}", **(engine_options or {}))
        bus = JetStreamBus(bus_config(url, subjects, "frontend", cluster.auth("frontend")))
        await bus.connect()
        cluster.buses.append(bus)
        cluster.gateway = Gateway(bus, config)
        await cluster.gateway.start()
        cluster.app = create_app(config, gateway=cluster.gateway)
        await cluster.wait_instances(instances)
        yield cluster
    finally:
        if cluster.server is not None:
            cluster.server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(cluster.server_task, 5.0)
        if cluster.gateway is not None:
            await cluster.gateway.stop()
        for agent in cluster.agents.values():
            with contextlib.suppress(Exception):
                await agent.stop()
        for bus in cluster.buses:
            with contextlib.suppress(Exception):
                await bus.close()
        cleaning = bus_config(url, subjects, "cleaner", cluster.auth("admin"))
        cleaner = JetStreamBus(dataclasses.replace(cleaning, provision=False))
        await cleaner.connect()
        jsm = cleaner.client.jsm()
        for stream in (subjects.events_stream, subjects.loads_stream, subjects.history_stream,
                       subjects.kv_stream, f"KV_{subjects.kv_bucket}", f"KV_{subjects.responses_bucket}"):
            with contextlib.suppress(Exception):
                await (jsm.delete_stream(stream) if secure is None else jsm.purge_stream(stream))
        await cleaner.close()


async def disconnect_after_first_text(
    cluster: Cluster, url: str, body: dict[str, Any], *, polls: int
) -> None:
    """Stream ``body``, hang up at the first text chunk, then wait (``polls`` x 20 ms) for idle engines."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"text":"' in line:
                    break
    for _ in range(polls):
        if not any(agent.engine.has_unfinished() for agent in cluster.agents.values()):
            break
        await asyncio.sleep(0.02)
