"""Pacing a migration's stage copies to the engine's steps, so they do not stall co-located decoding.

Unpaced, a stage's copy (export, send, receive, write) runs as fast as it can,
beside the engine's steps on the same cores: the requests decoding on both
instances slow down for as long as the copy lasts. With
``MigrationConfig.copy_step_share`` = ``s`` > 0, the shells move a stage in
chunks instead, each sized to cost about ``s`` of one engine step (from the
measured cost of the chunks so far and the recent step times), and at most
one chunk per step: a chunk starts once a step has completed since the last
one ended, and no sooner than its work time x ``(1 - s) / s`` after it (the
duty cycle, which also paces a step that does not come). What a chunk's own
timing misses (the receiver's work, contention for the interpreter lock)
shows in the steps: while a step beside the copy runs more than ``1 + s``
times the step before the copy, the chunks are spaced further apart (up to
16x). An idle engine (no step for 4 step times, at least 1 s) has nothing to
stall: the rest of its copy goes at full speed. Which stages are paced is :meth:`MigrationConfig.paces`: never
the last one (the request is suspended: the downtime), nor one of a few
blocks. A stage whose paced copy would not finish within half its
``copy_timeout_s`` (the destination's write: a quarter) goes at full speed,
so pacing does not turn into a copy timeout.

Pacing trades a slower copy for steadier decoding, which is worth it only while
nothing waits for the copy: :meth:`CopyPacer.hurry` sends the rest of a stage
at full speed at once (a chunk's wait ends early). The shells hurry a migration
when its source turns short of memory while it copies (checked before each
chunk: the ``urgent`` callback) and when another migration wants the slot it
holds at either end (:mod:`agents.migration.manager`); the simulator models
the same (:mod:`scheduler.sim`).

:class:`StepClock` is the agent's record of its steps (the migration manager
feeds it); :class:`CopyPacer` sizes and spaces one stage's chunks. Both are
plain asyncio; the sizes come in "units" (blocks) so the same pacer serves the
source's exports and sends and the destination's writes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable

from bus.event_loop import wait_event

__all__ = ["CopyPacer", "StepClock", "splits_by_block"]

#: Steps whose durations the step-time estimate takes the median of.
_STEP_WINDOW = 8
#: The most a pacer spaces chunks beyond its duty cycle.
_MAX_STRETCH = 16.0


def splits_by_block(engine_name: str) -> bool:
    """Whether the engine's KV buffers are block-major: blocks ``[a, b)`` of a buffer are its
    bytes ``[a * P, b * P)`` (``P`` its payload bytes per block), so a stage can be exported
    and written chunk by chunk. True of the torch engine (one gather of whole blocks) and the
    sim engine (a fingerprint per block); vLLM's buffers are layer-major: its stages are
    exported and written whole, and only their sending is paced."""
    return engine_name in ("torch", "sim")


class StepClock:
    """The engine steps of one agent: how many completed, how long they took, a wake-up per step."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.last_step_at = -float("inf")  # perf_counter() when the latest step completed
        self._durations: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._waiters: list[asyncio.Future[None]] = []

    def step_done(self, duration_s: float) -> None:
        self.num_steps += 1
        self.last_step_at = time.perf_counter()
        if duration_s > 0:
            self._durations.append(duration_s)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def stepping(self) -> bool:
        """Whether the engine is stepping now: a step completed within 4 step times (at least 1 s)."""
        step = self.step_s
        return step is not None and time.perf_counter() - self.last_step_at <= max(1.0, 4 * step)

    @property
    def last_step_s(self) -> float | None:
        """The latest step's time (None before any step)."""
        return self._durations[-1] if self._durations else None

    @property
    def step_s(self) -> float | None:
        """The median of the recent step times (None before any step)."""
        return statistics.median(self._durations) if self._durations else None

    async def wait_step(self, after: int, timeout: float) -> bool:
        """Wait until more than ``after`` steps completed, at most ``timeout`` seconds; whether they did."""
        if self.num_steps > after:
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            return False
        return True


class CopyPacer:
    """Sizes and spaces the chunks of one stage (``total`` units) to ``share`` of the engine's steps.

    Call :meth:`next_chunk` before each chunk's work, with the units done so
    far: it waits for the chunk's turn and returns how many units it may
    cover; the work of a chunk is timed from that return to the next call.
    ``num_chunks`` and ``largest_chunk`` say how the stage was cut.
    """

    def __init__(
        self,
        clock: StepClock,
        *,
        share: float,
        total: int,
        time_limit_s: float,
        urgent: Callable[[], bool] | None = None,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.clock = clock
        self.share = share
        self.total = total
        self.time_limit_s = time_limit_s
        self.num_chunks = 0
        self.largest_chunk = 0
        self.unpaced = False  # went at full speed: to stay within the time limit, or hurried
        self.hurried = False  # :meth:`hurry` was called (or ``urgent`` said so)
        #: asked before each chunk: whether the rest should go at full speed now
        self.urgent = urgent
        self._hurry = asyncio.Event()
        #: the step time before the copy began, which the chunks must not stretch by more than ``share``
        self.baseline_s = clock.step_s
        #: how much longer than the duty cycle says the chunks are spaced (grows while steps run slow)
        self.stretch = 1.0
        self._started = time.perf_counter()
        self._units_per_s: float | None = None
        self._chunk_started: float | None = None
        self._chunk_units = 0

    def hurry(self) -> None:
        """Copy the rest of the stage at full speed: the next chunk is all that remains, and a
        wait for the next chunk's turn ends now."""
        self.hurried = self.unpaced = True
        self._hurry.set()

    async def next_chunk(self, done: int) -> int:
        remaining = self.total - done
        if remaining <= 0:
            raise ValueError(f"all {self.total} units are done")
        if self._chunk_started is not None:
            await self._after_chunk()
        units = self._size(remaining)
        self.num_chunks += 1
        self.largest_chunk = max(self.largest_chunk, units)
        self._chunk_units = units
        self._chunk_started = time.perf_counter()
        return units

    async def _after_chunk(self) -> None:
        """Time the chunk that just ended, then wait for its turn: a step completed, the duty cycle."""
        assert self._chunk_started is not None
        ended = time.perf_counter()
        work = max(ended - self._chunk_started, 1e-6)
        rate = self._chunk_units / work
        self._units_per_s = rate if self._units_per_s is None else 0.5 * (self._units_per_s + rate)
        if self.unpaced:
            return
        steps = self.clock.num_steps
        rest = work * (1 - self.share) / self.share * self.stretch
        step = self.clock.step_s
        await self._unless_hurried(
            self.clock.wait_step(steps, max(rest, 2 * step) if step is not None else rest)
        )
        left = rest - (time.perf_counter() - ended)
        if left > 0 and not self.unpaced:
            await wait_event(self._hurry, left)
        self._adjust()

    async def _unless_hurried(self, waiting: Awaitable[bool]) -> None:
        """Await ``waiting``, or until :meth:`hurry` is called."""
        wait = asyncio.ensure_future(waiting)
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait((wait, hurry), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (wait, hurry):
                task.cancel()

    def _adjust(self) -> None:
        """Space the chunks out further while the steps beside them run slower than ``1 + share``
        times the step before the copy (costs the chunk's own timing misses: the receiver's
        work, lock contention); come back towards the duty cycle while they do not."""
        last, baseline = self.clock.last_step_s, self.baseline_s
        if last is None or baseline is None:
            return
        if last > baseline * (1 + self.share):
            self.stretch = min(self.stretch * 1.5, _MAX_STRETCH)
        else:
            self.stretch = max(1.0, self.stretch / 1.25)

    def _size(self, remaining: int) -> int:
        if not self.unpaced and self.urgent is not None and self.urgent():
            self.hurry()
        if self.hurried:
            return remaining
        step = self.clock.step_s
        if step is None or not self.clock.stepping:  # an idle engine: nothing to stall
            return remaining
        rate = self._units_per_s
        if rate is None:  # the first chunk: one unit, to measure the cost of one
            return 1
        elapsed = time.perf_counter() - self._started
        if self.unpaced or elapsed + remaining / rate / self.share > self.time_limit_s:
            self.unpaced = True
            return remaining
        if self.baseline_s is not None:
            step = min(step, self.baseline_s)  # the budget comes from the step the copy must not slow
        return max(1, min(remaining, int(rate * step * self.share)))
