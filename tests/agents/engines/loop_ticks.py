"""Counting how often the event loop gets to run other coroutines while something is awaited."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class LoopTicks:
    """``count`` grows by one each time a busy-yielding coroutine runs; ``reset`` before a measurement."""

    def __init__(self) -> None:
        self.count = 0

    def reset(self) -> None:
        self.count = 0

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def loop_ticks() -> AsyncIterator[LoopTicks]:
    ticks = LoopTicks()
    task = asyncio.create_task(ticks._tick())
    await asyncio.sleep(0)
    try:
        yield ticks
    finally:
        task.cancel()
