"""Running a component's main coroutine on the fastest event loop at hand.

Every long-running ``shoal`` process (scheduler, agents, the benchmarks'
load generators; uvicorn picks the same loop for ``shoal serve``) runs its
top-level coroutine through :func:`run`, which uses uvloop where it is
installed (a dependency on Linux and macOS) and the standard asyncio loop
otherwise. uvloop's C event loop and transports cut the CPU each message costs
(``shoal bench cluster`` at 500 req/s: the scheduler's CPU share drops by about
a quarter), which is what dispatch and step-loop tail latency depend on when
NATS, the scheduler and the agents share a few cores.

:func:`wait_event` is the one way the packages wait for an event with a timeout (see its note;
``asyncio.wait_for`` is banned there by the lint configuration), and :func:`cancel_and_wait` the
way a component ends its own tasks.

Not here: anything that reads the environment or picks a loop per call site.
In-process tests run on pytest-asyncio's standard loop, so both loops are exercised.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["cancel_and_wait", "loop_factory", "loop_name", "run", "wait_event"]

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


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds; whether it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11 ``wait_for`` drops a
    cancellation that arrives in the loop turn the event is set (CPython gh-86296, fixed in 3.12),
    so a loop around it goes on after its task was cancelled, and whoever awaits that task (an
    agent's ``kill``, a scheduler's teardown) waits forever. ``asyncio.timeout`` keeps it.
    """
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


#: Seconds a cancelled task has to end (its cleanup included) before :func:`cancel_and_wait` cancels it again.
RECANCEL_S = 1.0


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again those that go on.

    A cancellation can be lost inside code that is not ours: nats-py awaits its replies with
    Python 3.11's ``asyncio.wait_for``, which drops a cancel that arrives with the reply (see
    :func:`wait_event`), and a loop around such a call (a lease renewal, an archive flush) then
    runs on. Waiting once for such a task hangs its owner's stop; a second cancel, at the task's
    next await, ends it. A cancellation of the caller itself propagates. What the tasks raised is
    retrieved and dropped (their owners log their failures as they happen).
    """
    ending = list(tasks)
    pending = {task for task in ending if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in ending:
        if not task.cancelled():
            task.exception()
