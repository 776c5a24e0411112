"""``ScheduledEngine``: what every engine built on the shared local scheduler has in common.

The sim and torch engines differ in how a step is computed (a timing model or
a forward pass) and in what a KV buffer carries (fingerprints or tensors). The
rest of the :class:`~agents.engines.protocol.Engine` protocol is the local scheduler's:
reservations, suspend/resume, stats, events, the real-time stepping loop and
the checks an imported buffer must pass before its payload is looked at. This
base class holds that part once; an engine sets ``self.scheduler`` and
``self._info`` in its constructor and implements ``step_async`` (and the rest
of the protocol), overriding a delegating method where it must do more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from agents.engines.block_manager import CacheDelta, Reservation
from agents.engines.local_scheduler import LocalScheduler
from agents.engines.protocol import (
    EngineInfo,
    EngineStats,
    KVBuffer,
    MigrationError,
    RequestStats,
    SchedulerEvent,
    StepResult,
)
from schemas import SamplingParams

__all__ = ["ScheduledEngine"]


class ScheduledEngine:
    """The scheduler-backed part of an engine; subclasses set ``scheduler`` and ``_info``."""

    scheduler: LocalScheduler
    _info: EngineInfo
    #: ``suspend`` holds a request that is still queued (never ran, no KV) out of the queue and
    #: ``resume`` queues it again: what a move without KV needs (``agents.migration``).
    holds_queued_requests = True

    @property
    def info(self) -> EngineInfo:
        return self._info

    # ------------------------------------------------------------ serving

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        return self.scheduler.add_request(
            request_id, prompt_token_ids, sampling, priority, output_token_ids=output_token_ids
        )

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} does not implement step_async")

    async def run_until_idle(
        self,
        on_result: Callable[[StepResult], None] | None = None,
        *,
        idle_sleep_s: float = 0.001,
        max_steps: int | None = None,
    ) -> int:
        """Step in real time until no request is left; returns the number of steps.

        When nothing can be scheduled (only suspended requests, or the queue
        waits for reserved blocks) it sleeps ``idle_sleep_s`` instead of spinning.
        """
        steps = 0
        while self.has_unfinished() and (max_steps is None or steps < max_steps):
            result = await self.step_async()
            steps += 1
            if on_result is not None:
                on_result(result)
            if result.num_scheduled == 0:
                await asyncio.sleep(idle_sleep_s)
        return steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def request_stats(self, request_id: str) -> RequestStats | None:
        request = self.scheduler.get(request_id)
        return None if request is None else self.scheduler.request_stats(request)

    def output_token_ids(self, request_id: str) -> tuple[int, ...]:
        return self.scheduler.request(request_id).output_token_ids

    def take_cache_delta(self) -> CacheDelta:
        return self.scheduler.take_cache_delta()

    def cached_block_hashes(self) -> list[int]:
        return self.scheduler.cached_block_hashes()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def take_events(self) -> list[SchedulerEvent]:
        return self.scheduler.take_events()

    def migration_blocker(self, request_id: str) -> str | None:
        """Why ``request_id`` cannot move now, or None (raises UnknownRequest if absent).

        Only a request that has decoded carries all its KV: one still in its
        (maybe chunked) prefill has none yet for the tokens it has not computed.
        """
        request = self.scheduler.request(request_id)
        if request.num_computed_tokens < request.num_tokens - 1:
            return "its prompt is still being prefilled"
        return None

    # ---------------------------------------------------------- migration

    def reserve(self, num_blocks: int) -> Reservation:
        return self.scheduler.reserve(num_blocks)

    def hold_cached_blocks(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        """For an incoming migration: one reference to each cached block of the longest leading
        run of ``block_hashes`` (the request's chain), so none of them is evicted before the
        request is admitted with them (``admit_migrated(cached_block_ids=...)``) or the migration
        gives up (:meth:`drop_held_blocks`). Nothing is copied into them: a cached block's KV is
        the chain's. ``()`` with the prefix cache off."""
        blocks = self.scheduler.blocks
        held = blocks.lookup(block_hashes)
        blocks.share(held)
        return tuple(held)

    def drop_held_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block :meth:`hold_cached_blocks` returned."""
        self.scheduler.blocks.free(block_ids)

    def _payload_problem(self, buffer: KVBuffer) -> str | None:
        """Why this engine cannot read ``buffer``'s payload, or None; checked by :meth:`_check_import`."""
        return None

    def _check_import(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        """MigrationError unless ``buffer`` fits ``block_ids``, its payload is readable, all are reserved."""
        bytes_per_block = self._info.bytes_per_block
        if buffer.num_blocks != len(block_ids):
            raise MigrationError(f"buffer holds {buffer.num_blocks} blocks, {len(block_ids)} block ids given")
        if buffer.nbytes != buffer.num_blocks * bytes_per_block:
            raise MigrationError(
                f"buffer of {buffer.nbytes} bytes for {buffer.num_blocks} blocks of {bytes_per_block} bytes: "
                "KV layouts differ"
            )
        problem = self._payload_problem(buffer)
        if problem is not None:
            raise MigrationError(problem)
        blocks = self.scheduler.blocks
        not_reserved = [b for b in block_ids if blocks.reservation_of(b) is None]
        if not_reserved:
            raise MigrationError(f"blocks {not_reserved[:5]} are not reserved; reserve before importing")

    def release_request(self, request_id: str) -> int:
        return self.scheduler.release_request(request_id)

    def release_reservation(self, reservation: Reservation) -> int:
        return self.scheduler.release_reservation(reservation.reservation_id)

    def suspend(self, request_id: str) -> None:
        self.scheduler.suspend(request_id)

    def resume(self, request_id: str) -> None:
        self.scheduler.resume(request_id)
