"""Carrying out scale decisions: the ``InstanceManager`` port and a local-process implementation.

The scheduler decides *that* the cluster should grow or shrink (``ScaleUp`` /
``ScaleDown`` in the log); an :class:`InstanceManager` makes it happen. A
scale-down first drains the instance (the scheduler sends ``Drain``; the
agent migrates its requests away and leaves), then the manager is asked to
reap it. :class:`LocalProcessManager` (used by ``shoal up``) runs each agent
as a child process from a command template; a cluster manager such as
Kubernetes would implement the same protocol by scaling a Deployment.
:class:`RecordingManager` only records the calls (tests, dry runs).
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from collections.abc import Sequence
from typing import Protocol

__all__ = ["InstanceManager", "LocalProcessManager", "RecordingManager"]


class InstanceManager(Protocol):
    """Starts and stops engine instances (each runs an agent that joins by itself)."""

    async def start_instances(self, count: int) -> list[str]:
        """Launch ``count`` instances; returns the ids they will join with."""
        ...

    async def stop_instance(self, instance_id: str) -> None:
        """Stop an instance that drained (or failed); idempotent, unknown ids are ignored."""
        ...

    async def close(self) -> None:
        """Stop every instance this manager started."""
        ...


class RecordingManager:
    """Records start/stop calls; starts nothing."""

    def __init__(self, prefix: str = "scaled") -> None:
        self.prefix = prefix
        self.started: list[str] = []
        self.stopped: list[str] = []
        self._ids = itertools.count()

    async def start_instances(self, count: int) -> list[str]:
        ids = [f"{self.prefix}-{next(self._ids)}" for _ in range(count)]
        self.started.extend(ids)
        return ids

    async def stop_instance(self, instance_id: str) -> None:
        if instance_id not in self.stopped:
            self.stopped.append(instance_id)

    async def close(self) -> None:
        return None


class LocalProcessManager:
    """Runs agents as local child processes.

    ``command`` is the argv of one agent with ``{instance_id}`` where its id
    goes, e.g. ``("shoal", "agent", "--engine", "sim", "--instance-id", "{instance_id}",
    "--nats", "nats://127.0.0.1:4222")``. ``stop_grace_s`` is how long a stopped
    agent may take to leave after SIGTERM before it is killed.
    """

    def __init__(
        self, command: Sequence[str], *, id_prefix: str = "inst", stop_grace_s: float = 10.0
    ) -> None:
        if not any("{instance_id}" in part for part in command):
            raise ValueError("command must contain {instance_id}")
        self.command = tuple(command)
        self.id_prefix = id_prefix
        self.stop_grace_s = stop_grace_s
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self._ids = itertools.count()

    def _next_id(self) -> str:
        while True:
            instance_id = f"{self.id_prefix}-{next(self._ids)}"
            if instance_id not in self.processes:
                return instance_id

    async def start_instances(self, count: int) -> list[str]:
        started = []
        for _ in range(count):
            instance_id = self._next_id()
            argv = [part.replace("{instance_id}", instance_id) for part in self.command]
            self.processes[instance_id] = await asyncio.create_subprocess_exec(*argv)
            started.append(instance_id)
        return started

    async def stop_instance(self, instance_id: str) -> None:
        process = self.processes.pop(instance_id, None)
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_grace_s):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_instance(i) for i in list(self.processes)))
