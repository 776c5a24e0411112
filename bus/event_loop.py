"""Running a component's main coroutine on the fastest event loop at hand.

Every long-running ``shoal`` process (scheduler, agents, the benchmarks'
load generators; uvicorn picks the same loop for ``shoal serve``) runs its
top-level coroutine through :func:`run`, which uses uvloop where it is
installed (a dependency on Linux and macOS) and the standard asyncio loop
otherwise. uvloop's C event loop and transports cut the CPU each message costs
(``shoal bench cluster`` at 500 req/s: the scheduler's CPU share drops by about
a quarter), which is what dispatch and step-loop tail latency depend on when
NATS, the scheduler and the agents share a few cores.

Not here: anything that reads the environment or picks a loop per call site.
In-process tests run on pytest-asyncio's standard loop, so both loops are exercised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "loop_name", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor if uvloop is installed, else None (the standard loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` uses (for benchmark reports)."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop where available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
