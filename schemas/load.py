"""Load reports: what an agent tells the cluster about its usage and freeness.

Appended by agents on ``<prefix>.load.<instance_id>`` (the ``loads`` stream).
A report carries the computed freeness *and* the inputs it came from, so the
scheduler, ``shoal replay --what-if`` and the simulator can recompute it.
"""

from __future__ import annotations

from schemas.base import Message

__all__ = ["LoadReport", "PriorityLoad", "QueuedRequest"]


class PriorityLoad(Message, frozen=True, kw_only=True, tag="priority_load"):
    """Running requests of one priority and the physical blocks they hold."""

    priority: int
    num_running: int
    num_blocks: int


class QueuedRequest(Message, frozen=True, kw_only=True, tag="queued_request"):
    """A request queued on the reporting instance that never ran anywhere and never moved: the one
    the scheduler may move (no KV) when the queue stalls (``LoadReport.requeue_candidate``)."""

    request_id: str
    num_prompt_tokens: int
    priority: int = 0


class LoadReport(Message, frozen=True, kw_only=True, tag="load_report"):
    instance_id: str
    seq: int
    num_total_blocks: int
    num_free_blocks: int
    num_reserved_blocks: int
    running: tuple[PriorityLoad, ...]
    head_of_line_demand: int
    num_waiting: int
    batch_size: int
    freeness: float
    virtual_usage: float
    num_accepted: int
    head_of_line_priority: int = 0
    terminating: bool = False
    num_migrating_out: int = 0
    num_migrating_in: int = 0
    #: Blocks every waiting request would need (head of line included); INFaaS++ load.
    waiting_demand: int = 0
    #: Preemptions by recompute since the engine started (cumulative; exported by frontends).
    num_preemptions: int = 0
    #: Seconds the head of the queue has waited here (0: nothing queued).
    head_of_line_wait_s: float = 0.0
    #: The newest queued request that never ran and never moved (the head only when it is alone);
    #: None if there is none.
    requeue_candidate: QueuedRequest | None = None
    #: Blocks the requests holding blocks here are still expected to take as they decode, from an
    #: output length the agent learned from the requests it finished
    #: (``scheduler.policy.growth.expected_growth_blocks``); 0: no estimate yet (and in older logs).
    expected_growth_blocks: int = 0
    #: Blocks of prompt tokens admitted here whose prefill is not done yet: the prompts of the step
    #: in flight (an unchunked engine prefills every prompt it admits in one step) and the rest of a
    #: chunked prompt. What a request placed here waits to see computed before its own step even
    #: when nothing is queued. 0 in older logs.
    prefill_blocks: int = 0
    #: Blocks of the waiting requests' prompts (``waiting_demand``) that the engine's prefix cache does
    #: not hold at report time: the prefill work the queue really brings. -1: not known (older logs,
    #: engines without a prefix cache); read as ``waiting_demand``.
    waiting_uncached_blocks: int = -1
