"""Load reports from engine stats: the agent's virtual usage and freeness, with their inputs.

Pure: :func:`build_load_report` turns an :class:`~agents.engines.protocol.EngineStats`
snapshot into a :class:`~schemas.LoadReport` using the shared policy functions
(:func:`scheduler.policy.instance_freeness`, :func:`~scheduler.policy.group_running`),
so the agent and the scheduler agree on every number. :func:`load_signature`
is what "something changed" compares, :func:`urgent_signature` the part of it the
scheduler must see at once (the rest — blocks growing under decoding requests —
may wait a little while the engine is busy). No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable

from agents.engines.protocol import EngineStats, RequestStats, RequestStatus
from scheduler.config import PolicyConfig
from scheduler.policy import (
    RunningRequest,
    blocks_for_tokens,
    group_running,
    instance_freeness,
    virtual_usage,
)
from scheduler.policy.growth import expected_growth_blocks
from schemas import LoadReport, QueuedRequest

__all__ = [
    "build_load_report",
    "load_signature",
    "queued_in_order",
    "requeue_candidate",
    "running_requests",
    "urgent_signature",
]


def running_requests(stats: EngineStats) -> tuple[RunningRequest, ...]:
    """Every request holding blocks (running or suspended), as the policy functions see it."""
    return tuple(
        RunningRequest(
            priority=r.priority,
            num_blocks=r.num_blocks,
            request_id=r.request_id,
            num_tokens=r.num_tokens,
        )
        for r in stats.requests
        if r.status.holds_blocks
    )


def build_load_report(
    stats: EngineStats,
    *,
    instance_id: str,
    seq: int,
    block_size: int,
    num_accepted: int,
    config: PolicyConfig,
    terminating: bool = False,
    num_migrating_out: int = 0,
    num_migrating_in: int = 0,
    head_of_line_wait_s: float = 0.0,
    requeue_candidate: QueuedRequest | None = None,
    expected_output_tokens: int = 0,
    waiting_cached_blocks: int | None = None,
) -> LoadReport:
    """The report of one engine snapshot; freeness counts reserved (migrating-in) blocks as used.

    ``head_of_line_wait_s`` and ``requeue_candidate`` (:func:`requeue_candidate`) come from the
    agent, which knows when each request was queued and whether it ever moved;
    ``expected_output_tokens`` from the requests it finished
    (:class:`~scheduler.policy.growth.OutputLengthEstimate`; 0: none yet), which gives the
    report's ``expected_growth_blocks``. ``waiting_cached_blocks``: the blocks of the waiting
    requests' prompts the engine's prefix cache holds now (None: the engine's own count,
    ``EngineStats.waiting_cached_blocks``), which gives ``waiting_uncached_blocks``."""
    running = running_requests(stats)
    if waiting_cached_blocks is None:
        waiting_cached_blocks = stats.waiting_cached_blocks
    growth = expected_growth_blocks(
        (
            (r.num_tokens, r.num_prompt_tokens, r.num_blocks)
            for r in stats.requests
            if r.status.holds_blocks
        ),
        expected_output_tokens,
        block_size,
    )
    waiting_demand = sum(
        blocks_for_tokens(r.num_tokens, block_size)
        for r in stats.requests
        if r.status is RequestStatus.WAITING or r.status is RequestStatus.PREEMPTED
    )
    prefill_blocks = sum(
        blocks_for_tokens(r.num_tokens - r.num_computed_tokens, block_size)
        for r in stats.requests
        if r.status.holds_blocks and r.num_tokens - r.num_computed_tokens > 1
    )
    usage = virtual_usage(
        running,
        stats.head_of_line_demand,
        config=config,
        terminating=terminating,
        num_reserved_blocks=stats.num_reserved_blocks,
    )
    free = instance_freeness(
        stats.num_total_blocks,
        running,
        stats.head_of_line_demand,
        config=config,
        terminating=terminating,
        num_reserved_blocks=stats.num_reserved_blocks,
    )
    return LoadReport(
        instance_id=instance_id,
        seq=seq,
        num_total_blocks=stats.num_total_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_reserved_blocks=stats.num_reserved_blocks,
        running=group_running(running),
        head_of_line_demand=stats.head_of_line_demand,
        num_waiting=stats.num_waiting,
        batch_size=len(running),
        freeness=free,
        virtual_usage=usage,
        num_accepted=num_accepted,
        head_of_line_priority=stats.head_of_line_priority,
        terminating=terminating,
        num_migrating_out=num_migrating_out,
        num_migrating_in=num_migrating_in,
        waiting_demand=waiting_demand,
        num_preemptions=stats.num_preemptions,
        head_of_line_wait_s=head_of_line_wait_s,
        requeue_candidate=requeue_candidate,
        expected_growth_blocks=growth,
        prefill_blocks=prefill_blocks,
        waiting_uncached_blocks=max(waiting_demand - waiting_cached_blocks, 0),
    )


def queued_in_order(stats: EngineStats) -> list[RequestStats]:
    """The queued requests (waiting or preempted) in the order they would be admitted."""
    queued = [r for r in stats.requests if r.status.is_queued]
    return sorted(queued, key=lambda r: (r.priority, r.arrival_seq))


def requeue_candidate(stats: EngineStats, eligible: Callable[[RequestStats], bool]) -> QueuedRequest | None:
    """The request a stalled queue may lose without KV: the newest queued one that never ran
    (the head only when it is alone), if ``eligible`` (never moved, not moving) says it may go.
    Only the newest such request is offered, as the simulator does."""
    queued = queued_in_order(stats)
    for request in reversed(queued[1:] or queued):
        never_ran = (
            request.status is RequestStatus.WAITING
            and request.num_computed_tokens == 0
            and request.num_tokens == request.num_prompt_tokens
        )
        if never_ran and eligible(request):
            return QueuedRequest(
                request_id=request.request_id,
                num_prompt_tokens=request.num_prompt_tokens,
                priority=request.priority,
            )
    return None


def load_signature(report: LoadReport) -> tuple[object, ...]:
    """The parts of a report whose change warrants a new report before the heartbeat is due."""
    return (
        report.num_free_blocks,
        report.num_reserved_blocks,
        report.running,
        report.head_of_line_demand,
        report.num_waiting,
        report.num_accepted,
        report.terminating,
        report.num_migrating_out,
        report.num_migrating_in,
        report.prefill_blocks,
        report.waiting_uncached_blocks,
    )


def urgent_signature(report: LoadReport) -> tuple[object, ...]:
    """What must reach the scheduler within one report interval: who runs and waits, what was
    accepted, reserved, migrating, terminating, and the prompts still to prefill (a step that admitted
    prompts began or ended: ``prefill_ahead`` dispatch ranks by it). Not in it: free blocks and the
    blocks each priority holds, which change with every block a decoding request fills (reported less
    often while busy)."""
    return (
        report.num_reserved_blocks,
        tuple((group.priority, group.num_running) for group in report.running),
        report.head_of_line_demand,
        report.num_waiting,
        report.num_accepted,
        report.terminating,
        report.num_migrating_out,
        report.num_migrating_in,
        report.prefill_blocks,
    )
