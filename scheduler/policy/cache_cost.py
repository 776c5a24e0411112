"""Per-instance costs of the cache-aware dispatch rules, over an :class:`InstanceLoad` and the
prefix index's answer for the request (how many of its prompt blocks the instance caches).

* :func:`ttft_terms` / :func:`predicted_ttft_key`: shoal's cost model (``predicted_ttft``), the
  predicted time to first token in blocks of prefill;
* :func:`kv_cost`: NVIDIA Dynamo's KV router cost (``kv``);
* :func:`prefix_scores`: llm-d's weighted scorers (``prefix``).

The formulas, their sources and defaults are in ``docs/policies.md``. Pure: no I/O, no clock.
Where the dispatchers look candidates up (a ranking kept across decisions instead of a scan of
every instance) is :mod:`scheduler.policy.cost_ranking`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from scheduler.config import CacheCostConfig, PolicyConfig
from scheduler.policy.load import InstanceLoad, _usage_and_batch

__all__ = [
    "NOT_AT_ONCE",
    "TtftTerms",
    "kv_base_cost",
    "kv_cost",
    "predicted_ttft_key",
    "prefix_scores",
    "ttft_terms",
]

#: The tie-break of an instance where the request would not start at once (below every room).
NOT_AT_ONCE = -math.inf


class TtftTerms(NamedTuple):
    """What :func:`predicted_ttft_key` reads of an instance for a request of one priority, before
    the request's own blocks: ``work`` (uncached prompt blocks queued ahead of it and dispatched
    there unreported), ``in_flight`` (prompt blocks admitted, not yet prefilled), ``room`` (blocks
    left after the running requests, headroom, reservations and the queue ahead) and ``slots``
    (running + pending + queued ahead + 1: what the room is shared by once it is admitted)."""

    work: int
    in_flight: int
    room: float
    slots: int


def ttft_terms(load: InstanceLoad, config: PolicyConfig, priority: int) -> TtftTerms:
    """The instance's side of the predicted TTFT of a request of ``priority`` (see :class:`TtftTerms`).

    A request of a higher priority (a lower value) than the instance's head of line skips its
    queue, as the engine serves by priority: for it the queue counts neither as work nor as room.
    """
    usage, batch = _usage_and_batch(load, config)
    skip = load.num_waiting > 0 and priority < load.head_of_line_priority
    queued = 0 if skip else max(load.waiting_demand, load.head_of_line_demand)
    num_queued = 0 if skip else load.num_waiting
    work = (0 if skip else load.queued_uncached_blocks) + load.pending_blocks
    room = load.num_total_blocks - (usage - load.head_of_line_demand) - queued
    return TtftTerms(work=work, in_flight=load.prefill_blocks, room=room, slots=batch + num_queued + 1)


def predicted_ttft_key(terms: TtftTerms, own_blocks: int, added_weight: float = 0.0) -> tuple[float, float]:
    """``(minus the cost in blocks of prefill, the tie-break)``; the larger key wins.

    ``own_blocks``: the request's prompt blocks the instance does not cache. With ``room`` left for
    them, the request waits for the queued, pending and in-flight prefill work, else for the
    larger of that queued and pending work and the memory deficit (as ``prefill_ahead``); then it
    prefills its own blocks: that is its predicted TTFT. The cost adds ``added_weight`` times its own
    blocks, the decode cost of what it adds (the steps of the requests decoding beside it that its
    prefill stretches), so a prompt prefilled again elsewhere costs more than its TTFT alone. Among
    instances where it starts at once (nothing ahead, room for it) the tie-break is the room per
    request after admitting it: the fuller the batch it joins, the slower each of its steps.

    Where no instance caches anything, ``own_blocks`` is the same everywhere and the order is
    ``prefill_ahead``'s.
    """
    room = terms.room - own_blocks
    work = terms.work + (terms.in_flight if room >= 0 else 0)
    ahead = max(work, -room)
    added = (1.0 + added_weight) * own_blocks
    if ahead > 0:
        return -(ahead + added), NOT_AT_ONCE
    return -added, room / terms.slots


def kv_base_cost(load: InstanceLoad, weight: float) -> float:
    """The part of :func:`kv_cost` the request does not change: ``w x`` the prefill blocks already
    assigned (uncached queued prompts, dispatches no report reflects yet, prompts in flight) plus
    the active blocks (used, reserved, queued and pending demand)."""
    prefill = load.queued_uncached_blocks + load.pending_blocks + load.prefill_blocks
    active = load.num_used_blocks + load.num_reserved_blocks + load.waiting_demand + load.pending_blocks
    return weight * prefill + active


def kv_cost(
    load: InstanceLoad,
    num_prompt_tokens: int,
    cached_tokens: int,
    config: CacheCostConfig,
    base: float | None = None,
) -> float:
    """Dynamo's KV router cost of the request on ``load``: ``w * prefill blocks + decode blocks``,
    the prefill blocks those already assigned plus the request's uncached prompt tokens over the
    block size, the decode blocks the active ones plus the request's. ``base``: the load's
    :func:`kv_base_cost` if known."""
    own_prefill = max(num_prompt_tokens - cached_tokens, 0) / load.block_size
    own_active = load.demand_blocks(num_prompt_tokens)
    weight = config.kv_overlap_weight
    if base is None:
        base = kv_base_cost(load, weight)
    return base + weight * own_prefill + own_active


def prefix_scores(
    loads: list[InstanceLoad], num_prompt_tokens: int, cached: dict[str, int], config: CacheCostConfig
) -> list[float]:
    """llm-d's score of each of ``loads`` (the eligible candidates): ``3 * prefix + 2 * queue +
    2 * KV utilisation`` at the default weights, each scorer in [0, 1]: the share of the prompt's
    blocks the instance caches, the queue length (waiting and pending requests) min-max normalised
    over the candidates (1 for the shortest; all 1 when equal), and one minus the share of KV blocks
    in use (used, reserved and pending)."""
    queues = [load.num_waiting + load.num_pending for load in loads]
    shortest, longest = (min(queues), max(queues)) if queues else (0, 0)
    spread = longest - shortest
    scores = []
    for load, queue in zip(loads, queues, strict=True):
        blocks = max(num_prompt_tokens // load.block_size, 1)
        prefix = min(cached.get(load.instance_id, 0) // load.block_size, blocks) / blocks
        queue_score = 1.0 if spread == 0 else (longest - queue) / spread
        in_use = load.num_used_blocks + load.num_reserved_blocks + load.pending_blocks
        utilization = min(max(in_use / max(load.num_total_blocks, 1), 0.0), 1.0)
        scores.append(
            config.prefix_weight * prefix
            + config.queue_weight * queue_score
            + config.kv_utilization_weight * (1.0 - utilization)
        )
    return scores
