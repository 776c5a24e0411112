"""``ShoalScheduler``: vLLM's V1 scheduler plus suspend/resume for the last migration stage.

Installed through vLLM's public seam ``SchedulerConfig.scheduler_cls``. A
suspended request keeps its status (``RUNNING``) and its KV blocks but sits in
:attr:`ShoalScheduler.suspended` instead of ``running``, so it is neither
scheduled nor chosen for preemption; vLLM's worker keeps the cached state of a
running request that is left out of a step, so :meth:`resume` just puts it
back at the end of ``running`` (the worker re-adds it to its batch). Aborting a
suspended request goes through vLLM's ``finish_requests`` unchanged (it frees
the blocks); this class only forgets it. A queued request that never ran can
be *held* (:meth:`hold`: out of ``waiting``, for a move without KV) and queued
again in its place (:meth:`unhold`). It also keeps the last
``SchedulerOutput`` for the engine's step statistics.

With KV cache events on (the engine turns them on with prefix caching), the events vLLM
hands its publisher at the end of each step are kept for the engine
(:meth:`take_kv_events`, with those its block pool queued since), and vLLM's prefix-cache
counters (queries and hits, in tokens) are kept from the start: vLLM keeps them only when
it logs statistics, which the in-process engine does not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import EventBatch, EventPublisher, KVCacheEvent
from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import RequestStatus

__all__ = ["ShoalScheduler"]


class _KeptEvents(EventPublisher):  # type: ignore[misc, unused-ignore]  # vLLM is Any without it
    """vLLM's publisher seam: keeps each step's KV cache events in a list instead of sending them."""

    def __init__(self) -> None:
        super().__init__(0)
        self.events: list[KVCacheEvent] = []

    def publish(self, events: EventBatch) -> None:
        self.events.extend(events.events)

    def shutdown(self) -> None:
        self.events.clear()


class ShoalScheduler(Scheduler):  # type: ignore[misc, unused-ignore]  # vLLM is Any without it
    """vLLM's scheduler with :meth:`suspend` and :meth:`resume`; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suspended: dict[str, Any] = {}
        #: queued requests that never ran, held out of ``waiting`` while they move without KV
        self.held: dict[str, Any] = {}
        self.last_output: Any = None
        self._kept_events: _KeptEvents | None = None
        if self.enable_kv_cache_events:
            self._kept_events = self.kv_event_publisher = _KeptEvents()
        manager = self.kv_cache_manager
        if manager.enable_caching and manager.prefix_cache_stats is None:
            manager.log_stats = True  # only gates these counters in the KV cache manager
            manager.prefix_cache_stats = PrefixCacheStats()

    def take_kv_events(self) -> list[Any]:
        """vLLM's KV cache events since the last call, in order (empty with events off)."""
        if self._kept_events is None:
            return []
        events, self._kept_events.events = self._kept_events.events, []
        events.extend(self.kv_cache_manager.take_events())  # queued since the last step's end
        return events

    def prefix_cache_counts(self) -> tuple[int, int]:
        """Tokens looked up in vLLM's prefix cache at admission and tokens found, since the start
        (re-admissions after a preemption included); (0, 0) with prefix caching off."""
        stats = self.kv_cache_manager.prefix_cache_stats
        if stats is None or not self.kv_cache_manager.enable_caching:
            return 0, 0
        return stats.queries + stats.preempted_queries, stats.hits + stats.preempted_hits

    def forget_cached_blocks(self) -> None:
        """Drop every cached block no request holds from vLLM's prefix cache and zero its counters.

        vLLM's own reset (``reset_prefix_cache``) refuses while any block is in use (a request's,
        a migration's reservation); then only the cached blocks nobody holds are evicted."""
        manager = self.kv_cache_manager
        if not manager.enable_caching:
            return
        pool = manager.block_pool
        if pool.get_num_free_blocks() == pool.num_gpu_blocks - 1:  # all free (block 0 is vLLM's null block)
            self.reset_prefix_cache()
        else:
            idle = {
                b.block_id
                for b in pool.blocks
                if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null
            }
            pool.evict_blocks(idle)
        manager.prefix_cache_stats = PrefixCacheStats()

    def cached_block_hashes(self) -> list[Any]:
        """The hash of every block vLLM's block pool caches now, as its KV cache events name it."""
        keys = self.kv_cache_manager.block_pool.cached_block_hash_to_block._cache
        return [maybe_convert_block_hash(get_block_hash(key)) for key in keys]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.last_output = super().schedule(*args, **kwargs)
        return self.last_output

    def suspend(self, request_id: str) -> bool:
        """Take a running request out of the batch, keeping its blocks; False if it is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING or request not in self.running:
            return False
        self.running.remove(request)
        self.suspended[request_id] = request
        return True

    def resume(self, request_id: str) -> bool:
        """Put a suspended request back into the batch; False if it is not suspended."""
        request = self.suspended.pop(request_id, None)
        if request is None:
            return False
        self.running.append(request)
        return True

    def hold(self, request_id: str) -> bool:
        """Take a queued request that never ran out of ``waiting`` (a move without KV); False if it
        is not such a request. It keeps its status (``WAITING``) and has no blocks."""
        request = self.requests.get(request_id)
        if (
            request is None
            or request.status != RequestStatus.WAITING
            or request.num_computed_tokens
            or request not in list(self.waiting)
        ):
            return False
        self.waiting.remove_request(request)
        self.held[request_id] = request
        return True

    def unhold(self, request_id: str) -> bool:
        """Queue a held request again in its place (by arrival; the priority queue orders itself)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        waiting = self.waiting
        if isinstance(waiting, deque):  # FCFS: before the first request that arrived after it
            later = next((i for i, r in enumerate(waiting) if r.arrival_time > request.arrival_time), None)
            if later is None:
                waiting.append(request)
            else:
                waiting.insert(later, request)
        else:
            waiting.add_request(request)
        return True

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: Any) -> Any:
        if isinstance(request_ids, str):
            ids: list[str] | None = [request_ids]
        else:
            ids = None if request_ids is None else list(request_ids)
        finished = super().finish_requests(ids, finished_status)
        for request_id in list(self.suspended) + list(self.held) if ids is None else ids:
            self.suspended.pop(request_id, None)
            self.held.pop(request_id, None)  # vLLM's own removal from ``waiting`` skips what is absent
        return finished
