"""The processes' event loop: uvloop (a dependency on Linux) when installed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bus import event_loop


async def _running_loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_run_uses_uvloop_where_it_is_installed() -> None:
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_running_loop_module()).startswith("uvloop")


async def _idle_loop(event: asyncio.Event, wakes: list[int]) -> None:
    """An agent's idle step loop in miniature: wait for work with a timeout, take it, wait again."""
    while True:
        if await event_loop.wait_event(event, 10.0):
            wakes.append(1)
            event.clear()


async def test_a_loop_on_wait_event_ends_when_cancelled_as_the_event_is_set() -> None:
    # asyncio.wait_for(event.wait(), t) on Python 3.11 dropped this cancel: the loop ran on
    event, wakes = asyncio.Event(), list[int]()
    task = asyncio.create_task(_idle_loop(event, wakes))
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert task in done and task.cancelled(), f"still running after {len(wakes)} wake(s)"


async def test_wait_event_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await event_loop.wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await event_loop.wait_event(event, 5.0)
    assert await event_loop.wait_event(event, 0)  # already set


async def _swallows_first_cancel(swallowed: list[int]) -> None:
    """What a library call that loses one cancellation does to the loop around it."""
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(1)
            current = asyncio.current_task()
            assert current is not None
            current.uncancel()


async def test_cancel_and_wait_ends_a_task_that_lost_the_first_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_loop, "RECANCEL_S", 0.01)  # cancel again 10 ms after the first cancel
    swallowed: list[int] = []
    stubborn = asyncio.create_task(_swallows_first_cancel(swallowed))
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    async with asyncio.timeout(5):
        await event_loop.cancel_and_wait([stubborn, finished])
    assert stubborn.cancelled() and swallowed == [1]
    assert finished.done() and not finished.cancelled()


async def test_cancel_and_wait_passes_on_a_cancel_of_its_caller() -> None:
    stuck = asyncio.create_task(asyncio.Event().wait())
    caller = asyncio.create_task(event_loop.cancel_and_wait([stuck]))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert stuck.cancelled()
