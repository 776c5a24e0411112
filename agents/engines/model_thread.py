"""``ModelThread``: the one thread an engine computes its model steps on, optionally pinned to CPUs.

Both built-in engines (torch and vLLM) run every forward pass on one dedicated
thread, never on the agent's event-loop thread nor a pool: one OpenMP team
does all the model's work, and the loop is free to serve the bus while a step
computes. With ``cpus`` (see :mod:`~agents.engines.cpu_binding`), the thread is
pinned first with ``sched_setaffinity`` (Linux affinity is per thread and
inherited by the OpenMP threads it starts) and gets one torch thread per CPU;
torch's process-wide default is put back, so the loop thread and KV-copy
threads are left as they were. Without ``cpus`` the thread runs unpinned with
torch's current default thread count.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ModelThread"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _bind(cpus: tuple[int, ...]) -> None:
    """Runs first on the model thread: pin it to ``cpus`` with one torch (OpenMP) thread per CPU.

    ``torch._C.set_num_threads`` is ``torch.set_num_threads``, which vLLM's CPU
    worker replaces with a no-op. The count is fixed for this thread by its
    first use (``get_num_threads``).
    """
    import torch

    os.sched_setaffinity(0, cpus)
    torch._C.set_num_threads(len(cpus))
    if torch.get_num_threads() != len(cpus):
        raise RuntimeError(f"model thread: got {torch.get_num_threads()} torch threads, not {len(cpus)}")


class ModelThread:
    """A one-thread executor named ``{name}-model``, pinned to ``cpus`` when given (see the module)."""

    def __init__(self, name: str, cpus: tuple[int, ...] = ()) -> None:
        self.name = name
        self.cpus = tuple(cpus)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-model")
        if self.cpus:
            self._pin()

    def _pin(self) -> None:
        import torch

        previous = torch.get_num_threads()
        try:
            self._executor.submit(_bind, self.cpus).result()
        finally:
            torch._C.set_num_threads(previous)  # this thread's and new threads' count, not the model thread's
        log.info(
            "%s engine: model thread pinned to CPUs %s with %d torch thread(s)",
            self.name,
            list(self.cpus),
            len(self.cpus),
        )

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        return self._executor.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the model thread; this thread waits for it."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)
