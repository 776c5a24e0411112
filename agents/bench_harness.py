"""The machinery of ``shoal bench migration``: agents on their own threads, KV filled without prefill.

Each :class:`AgentThread` runs one :class:`~agents.service.Agent` (torch engine,
its own NATS connection and transport) on an event loop in its own thread, so
the source keeps decoding while a copy runs and both engines compute in
parallel (torch releases the GIL; one intra-op thread each). The benchmark
thread talks to an agent through :meth:`AgentThread.call`, which runs a
function on the agent's loop (engines are not thread-safe).

:func:`admit_filled` puts a request with ``seq_len`` tokens of KV straight
into an engine's batch (reserve + ``admit_migrated``, as ``shoal bench
engine`` does) and registers it with the agent, which then publishes its
tokens like any other; KV values do not change the time of anything measured.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agents.agent import Agent, AgentConfig
from agents.engines.protocol import StepResult
from bus import BusConfig, JetStreamBus, event_loop
from schemas import SamplingParams, Subjects

__all__ = ["AgentThread", "StepSample", "admit_filled", "drop_everything"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepSample:
    """One engine step: when it ended (``time.perf_counter``), how long it took, whom it decoded."""

    ended_at: float
    duration_s: float
    num_decode_requests: int


@dataclass
class AgentThread:
    """One agent on its own thread and event loop."""

    build_engine: Callable[[], Any]
    config: AgentConfig
    nats_url: str
    subjects: Subjects
    agent: Agent | None = None
    steps: list[StepSample] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name=self.config.instance_id, daemon=True
        )
        self._thread.start()
        ready.result(timeout=300)

    def _main(self, ready: Future[None]) -> None:
        loop = (event_loop.loop_factory() or asyncio.new_event_loop)()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._boot())
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        loop.run_forever()

    async def _boot(self) -> None:
        engine = self.build_engine()
        bus = JetStreamBus(BusConfig(url=self.nats_url, subjects=self.subjects, name=self.config.instance_id))
        await bus.connect()
        agent = Agent(engine, bus, self.config)
        agent.step_listeners.append(self._on_step)
        await agent.start()
        self.agent = agent

    def _on_step(self, result: StepResult) -> None:
        if result.num_scheduled:
            self.steps.append(StepSample(time.perf_counter(), result.duration_s, result.num_decode_requests))

    def call(self, function: Callable[[Agent], T], timeout: float = 600.0) -> T:
        """Run ``function(agent)`` on the agent's loop (a coroutine result is awaited there)."""
        assert self._loop is not None and self.agent is not None
        agent = self.agent

        async def run() -> T:
            result: Any = function(agent)
            if asyncio.iscoroutine(result):
                result = await result
            return result  # type: ignore[no-any-return]

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is None:
            return
        if self.agent is not None:
            agent = self.agent

            async def shutdown() -> None:
                await agent.stop()
                await agent.bus.close()

            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)


def admit_filled(
    agent: Agent, request_id: str, seq_len: int, *, max_tokens: int = 1_000_000, salt: int = 0
) -> None:
    """Run a request of ``seq_len`` tokens (all but one already computed) on ``agent``; it then decodes."""
    engine = agent.engine
    block_size = engine.info.block_size
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompt = tuple((salt * 131 + t * 7) % 250 + 1 for t in range(seq_len - 1))
    outputs = (5,)
    reservation = engine.reserve(-(-(seq_len + 1) // block_size))
    engine.admit_migrated(request_id, prompt, outputs, sampling, 0, [reservation])
    agent.deltas.open(
        request_id,
        owner_epoch=0,
        stream=True,
        prompt_token_ids=prompt,
        sampling=sampling,
        priority=0,
        output_token_ids=outputs,
    )
    agent.wake()


def drop_request(agent: Agent, request_id: str) -> tuple[tuple[int, ...], int] | None:
    """Drop a request without a word to its subscribers; returns (prompt + outputs, prompt length)."""
    record = agent.request_record(request_id)
    if record is None:
        return None
    tokens = (*record.prompt_token_ids, *record.output_token_ids)
    agent.engine.abort(request_id)
    agent.forget_request(request_id)
    return tokens, record.num_prompt_tokens


def drop_everything(agent: Agent) -> None:
    for stats in agent.engine.stats().requests:
        drop_request(agent, stats.request_id)


def is_empty(agent: Agent) -> bool:
    stats = agent.engine.stats()
    return not agent.engine.has_unfinished() and stats.num_free_blocks == stats.num_total_blocks
