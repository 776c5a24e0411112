"""Virtual usage and freeness from plain request-level inputs (the paper's Algorithm 1).

For each request on an instance:

* running, normal priority: its physical blocks;
* running, high priority: physical blocks + headroom[class] / (running requests of that class);
* the head-of-line queued request: its demand (blocks for its prompt); other queued: 0;
* the fake request of a terminating instance: infinity.

Freeness ``F = (M - sum V) / B`` with ``M`` the block capacity and ``B`` the
batch size (running requests, 0 counted as 1). The agent computes its own F
with these functions from its engine stats; the scheduler recomputes it from a
load report (which carries the per-priority aggregates, see
:func:`virtual_usage_of_groups`), and both give the same number.

Blocks reserved for a request migrating *in* are physical blocks held for a
request that is not in the batch yet: callers may pass them as
``num_reserved_blocks`` (they add to ``sum V`` but not to ``B``); the default 0
is the paper's formula. Pure functions only: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from scheduler.config import PolicyConfig, PriorityClass
from schemas.load import PriorityLoad

__all__ = [
    "INFINITE_USAGE",
    "RunningRequest",
    "blocks_for_tokens",
    "freeness",
    "group_running",
    "instance_freeness",
    "request_virtual_usage",
    "scaling_freeness",
    "virtual_usage",
    "virtual_usage_of_groups",
]

#: Virtual usage of a terminating instance's fake request.
INFINITE_USAGE = math.inf


class RunningRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One running request as virtual usage and request selection see it.

    ``num_tokens`` (sequence length: prompt + generated) and ``request_id`` are
    only used by request selection; virtual usage reads priority and blocks.
    """

    priority: int
    num_blocks: int
    request_id: str = ""
    num_tokens: int = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return -(-max(num_tokens, 0) // block_size)


def group_running(running: Iterable[RunningRequest]) -> tuple[PriorityLoad, ...]:
    """Aggregate running requests per priority, as a :class:`~schemas.LoadReport` carries them."""
    counts: dict[int, list[int]] = {}
    for request in running:
        entry = counts.setdefault(request.priority, [0, 0])
        entry[0] += 1
        entry[1] += request.num_blocks
    return tuple(
        PriorityLoad(priority=priority, num_running=n, num_blocks=blocks)
        for priority, (n, blocks) in sorted(counts.items(), key=lambda item: item[0])
    )


def _headroom_of_priorities(priorities: Iterable[int], config: PolicyConfig) -> int:
    """Headroom reserved by the classes that have at least one running request."""
    seen: list[PriorityClass] = []
    total = 0
    for priority in priorities:
        cls = config.priority_class(priority)
        if cls.headroom_blocks and not any(cls is other for other in seen):
            seen.append(cls)
            total += cls.headroom_blocks
    return total


def virtual_usage_of_groups(
    running: Sequence[PriorityLoad],
    head_of_line_demand: int,
    *,
    config: PolicyConfig,
    terminating: bool = False,
    num_reserved_blocks: int = 0,
) -> float:
    """Sum of virtual usages from per-priority aggregates (what a load report carries).

    Each class's headroom, split among its running requests, sums back to the
    whole headroom once per class present, so aggregates are enough.
    """
    if terminating:
        return INFINITE_USAGE
    physical = sum(group.num_blocks for group in running)
    headroom = _headroom_of_priorities((g.priority for g in running if g.num_running > 0), config)
    return float(physical + headroom + head_of_line_demand + num_reserved_blocks)


def virtual_usage(
    running: Sequence[RunningRequest],
    head_of_line_demand: int,
    *,
    config: PolicyConfig,
    terminating: bool = False,
    num_reserved_blocks: int = 0,
) -> float:
    """Sum of the virtual usages of an instance's requests (running + queued + fake)."""
    if terminating:
        return INFINITE_USAGE
    physical = sum(request.num_blocks for request in running)
    headroom = _headroom_of_priorities((r.priority for r in running), config)
    return float(physical + headroom + head_of_line_demand + num_reserved_blocks)


def request_virtual_usage(
    request: RunningRequest, num_running_in_class: int, *, config: PolicyConfig
) -> float:
    """One running request's virtual usage: its blocks plus its share of its class's headroom."""
    headroom = config.headroom_blocks(request.priority)
    if headroom == 0:
        return float(request.num_blocks)
    return request.num_blocks + headroom / max(num_running_in_class, 1)


def freeness(num_total_blocks: int, total_virtual_usage: float, batch_size: int) -> float:
    """``F = (M - sum V) / B`` with ``B = 0`` counted as 1; ``-inf`` when usage is infinite."""
    return (num_total_blocks - total_virtual_usage) / (batch_size if batch_size > 0 else 1)


def instance_freeness(
    num_total_blocks: int,
    running: Sequence[RunningRequest],
    head_of_line_demand: int,
    *,
    config: PolicyConfig,
    terminating: bool = False,
    num_reserved_blocks: int = 0,
) -> float:
    """Freeness of an instance from its request-level state (what an agent computes)."""
    usage = virtual_usage(
        running, head_of_line_demand, config=config, terminating=terminating,
        num_reserved_blocks=num_reserved_blocks,
    )
    return freeness(num_total_blocks, usage, len(running))


def scaling_freeness(num_total_blocks: int, num_used_blocks: int, num_running: int) -> float:
    """Freeness of *normal* usage, for auto-scaling: physical blocks only.

    No headroom, no queued demand, no fake request (the paper's scaling metric).
    """
    return freeness(num_total_blocks, float(num_used_blocks), num_running)
