"""Several ``sim`` agents in one process, for ``shoal bench cluster`` (``python -m agents.bench_fleet``).

Each agent drives a :class:`LagSimEngine`: the sim engine with its step
completion timed against the modeled schedule, so the benchmark can report
how late agents' step loops run (actual against scheduled step start; a step
that ends late starts the next one late). On SIGTERM the process writes
``{instance_id: [[wall_time, lag_s], ...]}`` to ``--lag-out`` and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

from agents.agent import Agent, AgentConfig
from agents.engines.protocol import StepResult
from agents.engines.sim import SimEngine
from bus import BusConfig, JetStreamBus, event_loop
from schemas import Subjects

__all__ = ["LagSimEngine", "main"]


class LagSimEngine(SimEngine):
    """The sim engine, recording ``(wall time, lateness)`` of every step's completion."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lags: list[tuple[float, float]] = []

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        plan, duration = self.begin_step()
        scheduled_end = time.perf_counter() + duration
        if duration > 0:
            await asyncio.sleep(duration)
        self.lags.append((time.time(), time.perf_counter() - scheduled_end))
        return self.end_step(plan, duration)


async def run_agents(
    url: str, prefix: str, ids: list[str], lag_out: Path, profile: str, num_blocks: int | None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with JetStreamBus(BusConfig(url=url, subjects=Subjects(prefix), name="bench-agents")) as bus:
        engines: dict[str, LagSimEngine] = {}
        agents = []
        for instance_id in ids:
            engine = LagSimEngine(profile, num_blocks=num_blocks)
            agent = Agent(engine, bus, AgentConfig(instance_id=instance_id))
            await agent.start()
            engines[instance_id] = engine
            agents.append(agent)
        await stop.wait()
        lag_out.write_text(json.dumps({iid: engine.lags for iid, engine in engines.items()}))
        for agent in agents:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await agent.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--ids", required=True, help="comma-separated instance ids")
    parser.add_argument("--lag-out", required=True, type=Path)
    parser.add_argument("--profile", default="llama-7b-a10")
    parser.add_argument("--num-blocks", type=int, default=None)
    args = parser.parse_args()
    event_loop.run(
        run_agents(args.nats, args.prefix, args.ids.split(","), args.lag_out, args.profile, args.num_blocks)
    )


if __name__ == "__main__":
    main()
