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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

__all__ = ["ShoalScheduler"]


class ShoalScheduler(Scheduler):  # type: ignore[misc, unused-ignore]  # vLLM is Any without it
    """vLLM's scheduler with :meth:`suspend` and :meth:`resume`; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suspended: dict[str, Any] = {}
        #: queued requests that never ran, held out of ``waiting`` while they move without KV
        self.held: dict[str, Any] = {}
        self.last_output: Any = None

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
