"""The hang report names the task whose cancel did not end it, and where the others wait."""

from __future__ import annotations

import asyncio

from tests.hang_report import tasks_report


async def _loses_its_cancel(parked: asyncio.Event) -> None:
    """What a loop around Python 3.11's wait_for does when a cancel arrives with its result."""
    try:
        await asyncio.sleep(100)
    except asyncio.CancelledError:
        pass  # swallowed, and the task's cancel count stays up
    await parked.wait()


async def test_a_task_that_lost_its_cancel_is_reported_with_its_stack() -> None:
    parked = asyncio.Event()
    stuck = asyncio.create_task(_loses_its_cancel(parked), name="stuck-one")
    waiting = [asyncio.create_task(parked.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    stuck.cancel()
    await asyncio.sleep(0.01)
    report = tasks_report(asyncio.get_running_loop())
    parked.set()
    await asyncio.gather(stuck, *waiting)
    head, _, rest = report.partition("\n")
    assert "1 being cancelled" in head
    assert "-- cancelling: stuck-one" in rest and "_loses_its_cancel" in rest
    assert any(line.strip().startswith("3 x ") and "in wait" in line for line in rest.splitlines())
