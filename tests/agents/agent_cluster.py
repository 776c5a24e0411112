"""Test helpers for agents: several agents in one process, each with its own bus connection and transport.

:class:`AgentCluster` starts agents on the session nats-server under a prefix
unique to the test (and deletes its streams afterwards); :class:`TokenWatcher`
subscribes to a request's token subject and checks what a client would see:
tokens by index, no gap, no duplicate, the owner epochs seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from agents.agent import Agent, AgentConfig
from agents.engines.sim import SimEngine
from bus import BusConfig, JetStreamBus, NatsAuth, StreamConfig
from bus.protocol import Subscription
from schemas import Codec, GenerateReply, GenerateRequest, SamplingParams, Subjects, TokenDelta
from transport import TransportConfig

__all__ = ["AgentCluster", "TokenWatcher", "bus_config", "fast_agent_config", "sim_engine"]


def bus_config(url: str, subjects: Subjects, name: str = "test", auth: NatsAuth | None = None) -> BusConfig:
    return BusConfig(
        url=url,
        auth=auth or NatsAuth(),
        subjects=subjects,
        name=name,
        streams=StreamConfig(events_max_age=3600.0, loads_max_age=3600.0, loads_max_msgs_per_subject=100),
        ack_timeout=0.5,
        append_timeout=10.0,
        heartbeat=0.5,
        reconnect_time_wait=0.05,
        api_timeout=3.0,
    )


def fast_agent_config(instance_id: str, **changes: Any) -> AgentConfig:
    """Short intervals and timeouts, an in-process-friendly TCP transport."""
    from agents.migration.fsm.config import MigrationConfig

    base = AgentConfig(
        instance_id=instance_id,
        report_interval_s=0.05,
        heartbeat_interval_s=0.5,
        tick_interval_s=0.02,
        peer_lookup_timeout_s=2.0,
        migration=MigrationConfig(
            last_stage_max_blocks=2,
            max_stages=8,
            ack_timeout_s=0.5,
            copy_timeout_s=2.0,
            suspend_timeout_s=1.0,
            commit_timeout_s=0.5,
            claim_retry_s=0.3,
            destination_idle_timeout_s=3.0,
        ),
        transport=TransportConfig(kind="tcp", send_timeout_s=2.0, connect_timeout_s=1.0),
    )
    return replace(base, **changes)


def sim_engine(num_blocks: int = 64, time_scale: float = 1.0) -> SimEngine:
    return SimEngine("tiny-test", num_blocks=num_blocks, time_scale=time_scale)


@dataclass
class AgentCluster:
    url: str
    subjects: Subjects
    agents: dict[str, Agent] = field(default_factory=dict)
    client: JetStreamBus | None = None
    #: on a secured server (tests/conftest.py ``secure_nats``): each agent connects as its own user
    secure: Any = None
    codec: Codec = field(default_factory=lambda: Codec(producer="test-client"))

    async def add(self, engine: Any, config: AgentConfig, **kwargs: Any) -> Agent:
        auth = self.secure.auth(config.instance_id) if self.secure is not None else None
        bus = JetStreamBus(bus_config(self.url, self.subjects, config.instance_id, auth))
        await bus.connect()
        agent = Agent(engine, bus, config, **kwargs)
        await agent.start()
        self.agents[config.instance_id] = agent
        return agent

    @property
    def bus(self) -> JetStreamBus:
        assert self.client is not None
        return self.client

    async def generate(
        self, instance_id: str, request: GenerateRequest, timeout: float = 5.0
    ) -> GenerateReply:
        reply = await self.bus.request(
            self.subjects.rpc_agent(instance_id, "generate"),
            self.codec.encode(request, time=0.0),
            timeout=timeout,
        )
        body = self.codec.decode(reply.data).body
        assert isinstance(body, GenerateReply), body
        return body

    async def call(self, instance_id: str, method: str, body: Any, timeout: float = 5.0) -> Any:
        reply = await self.bus.request(
            self.subjects.rpc_agent(instance_id, method), self.codec.encode(body, time=0.0), timeout=timeout
        )
        return self.codec.decode(reply.data).body

    async def watch(self, request_id: str) -> TokenWatcher:
        subscription = await self.bus.subscribe(self.subjects.tok(request_id))
        return TokenWatcher(subscription, self.codec)

    async def stored(self, subject_filter: str, stream: str | None = None) -> list[Any]:
        """Bodies of every stored message under ``subject_filter`` (envelopes decoded)."""
        out = []
        async with self.bus.replay(stream or self.subjects.events_stream, subjects=[subject_filter]) as feed:
            async for message in feed:
                out.append((message.subject, self.codec.decode(message.data)))
        return out


@contextlib.asynccontextmanager
async def agent_cluster(url: str, secure: Any = None) -> AsyncIterator[AgentCluster]:
    """Agents under a fresh prefix; with ``secure`` (a ``SecureNats``), on its server, prefix and users.

    There the test client is the admin, and streams are purged afterwards (only the admin creates them).
    """
    subjects = Subjects(f"t{uuid.uuid4().hex[:12]}") if secure is None else secure.subjects
    url = url if secure is None else secure.url
    cluster = AgentCluster(url=url, subjects=subjects, secure=secure)
    admin = secure.auth("admin") if secure is not None else None
    cluster.client = JetStreamBus(bus_config(url, subjects, "client", admin))
    await cluster.client.connect()
    try:
        yield cluster
    finally:
        for agent in cluster.agents.values():
            if not agent.stopped.is_set():
                await agent.stop()
            with contextlib.suppress(Exception):
                await agent.bus.close()
        jsm = cluster.client.client.jsm()
        streams = (subjects.events_stream, subjects.loads_stream, subjects.kv_stream)
        for stream in (*streams, f"KV_{subjects.kv_bucket}"):
            with contextlib.suppress(Exception):
                await (jsm.delete_stream(stream) if secure is None else jsm.purge_stream(stream))
        await cluster.client.close()


class TokenWatcher:
    """Collects a request's token deltas as a client would and checks continuity."""

    def __init__(self, subscription: Subscription, codec: Codec) -> None:
        self.subscription = subscription
        self.codec = codec
        self.deltas: list[TokenDelta] = []
        self.arrivals: list[float] = []
        self.task = asyncio.get_running_loop().create_task(self._collect())
        self.finished = asyncio.Event()

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        async for message in self.subscription:
            body = self.codec.decode(message.data).body
            if isinstance(body, TokenDelta):
                self.deltas.append(body)
                self.arrivals.append(loop.time())
                if body.finish_reason is not None:
                    self.finished.set()

    async def wait_finished(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.finished.wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"the watched request did not finish within {timeout} s "
                                 f"({self._received()} tokens arrived)") from None

    async def wait_tokens(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` tokens arrived: the request is seen running (bounded, however slow the engine)."""
        try:
            async with asyncio.timeout(timeout):
                while self._received() < count:
                    assert not self.finished.is_set(), f"finished before {count} tokens"
                    await asyncio.sleep(0.002)
        except TimeoutError:
            raise AssertionError(f"{self._received()} of the watched request's first {count} tokens arrived "
                                 f"within {timeout} s") from None

    def _received(self) -> int:
        return sum(len(d.token_ids) for d in self.deltas)

    async def close(self) -> None:
        await self.subscription.unsubscribe()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    def tokens(self) -> list[int]:
        """Tokens by index; asserts every index is covered exactly once (no gap, no duplicate)."""
        by_index: dict[int, int] = {}
        for delta in self.deltas:
            for offset, token in enumerate(delta.token_ids):
                index = delta.first_index + offset
                assert index not in by_index, f"token index {index} delivered twice"
                by_index[index] = token
        assert sorted(by_index) == list(range(len(by_index))), f"gap in token indices: {sorted(by_index)}"
        return [by_index[i] for i in range(len(by_index))]

    def epochs(self) -> list[int]:
        return [d.owner_epoch for d in self.deltas]


def unmigrated_tokens(
    engine: Any, prompt: tuple[int, ...], sampling: SamplingParams, request_id: str = "reference"
) -> list[int]:
    """The tokens ``engine`` generates for one request run alone to the end (a migrated run equals them)."""
    engine.add_request(request_id, prompt, sampling)
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens.extend(output.token_ids)
    return tokens


def greedy(max_tokens: int, **changes: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **changes)
