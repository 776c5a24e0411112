"""The immutable per-instance view every policy reads, and the load measures over it.

:class:`InstanceLoad` is built from an instance's latest
:class:`~schemas.LoadReport` plus its :class:`~schemas.InstanceJoined`
(capacity, block size, model identity), plus the dispatches the scheduler made
to it that the report does not reflect yet (``num_pending`` requests holding
``pending_blocks`` blocks of prompt demand). Each pending dispatch counts as if
admitted: its demand adds to the virtual usage and it adds one to the batch.

The measures (:func:`load_freeness`, :func:`freeness_after_admit`,
:func:`infaas_load`, :func:`load_scaling_freeness`) are the request-level rules
of :mod:`scheduler.policy.virtual_usage` applied to a report's aggregates, so a
scheduler and an agent with the same :class:`~scheduler.config.PolicyConfig`
agree on every number. Pure: no I/O, no clock.
"""

from __future__ import annotations

import msgspec

from scheduler.config import PolicyConfig
from scheduler.policy.virtual_usage import INFINITE_USAGE, blocks_for_tokens, freeness
from schemas.instance import InstanceJoined
from schemas.load import LoadReport, PriorityLoad

__all__ = [
    "UNLIMITED_MODEL_LEN",
    "InstanceLoad",
    "compatibility_key",
    "freeness_after_admit",
    "infaas_load",
    "load_batch_size",
    "load_freeness",
    "load_scaling_freeness",
    "load_virtual_usage",
    "queue_aware_score",
    "room_blocks",
    "starts_at_once",
    "waits_for_memory",
]

#: ``max_model_len`` of a view built without an ``InstanceJoined``.
UNLIMITED_MODEL_LEN = 1 << 62


def compatibility_key(joined: InstanceJoined) -> str:
    """What must match for two instances to exchange KV cache: model identity, KV layout, the engine
    (its buffer format) and the KV transport (a UCX agent and a TCP one cannot reach each other)."""
    model, layout = joined.model, joined.kv_layout
    transport = joined.transport_kind or joined.transport_address.partition("://")[0]
    return (
        f"{model.model_id}@{model.revision}/{model.dtype}/tp{model.tensor_parallel}"
        f"|L{layout.num_layers}/H{layout.num_kv_heads}/D{layout.head_dim}"
        f"/B{layout.block_size}/{layout.dtype}|{joined.engine}|{transport}"
    )


class InstanceLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the scheduler knows about one instance's load. Build with :meth:`from_report`.

    ``reported`` is False for an instance that joined but has not reported yet
    (a *starting* instance: dispatchable as empty, left out of the scaling average).
    ``report_seq`` is the agent's report counter; ``stream_seq`` the report's
    position in the loads stream (what a decision cites).
    """

    instance_id: str
    num_total_blocks: int
    block_size: int = 16
    max_model_len: int = UNLIMITED_MODEL_LEN
    migration_group: str = ""
    running: tuple[PriorityLoad, ...] = ()
    num_reserved_blocks: int = 0
    head_of_line_demand: int = 0
    head_of_line_priority: int = 0
    waiting_demand: int = 0
    num_waiting: int = 0
    num_accepted: int = 0
    terminating: bool = False
    reported: bool = False
    report_seq: int = 0
    stream_seq: int = 0
    reported_freeness: float = 0.0
    num_pending: int = 0
    pending_blocks: int = 0
    num_preemptions: int = 0
    expected_growth_blocks: int = 0
    prefill_blocks: int = 0
    #: ``LoadReport.waiting_uncached_blocks`` (-1: not reported; :attr:`queued_uncached_blocks` reads it)
    waiting_uncached_blocks: int = -1

    @classmethod
    def from_joined(cls, joined: InstanceJoined) -> InstanceLoad:
        """An instance that joined and has not reported: empty, full capacity."""
        return cls(
            instance_id=joined.instance_id,
            num_total_blocks=joined.num_blocks,
            block_size=joined.block_size,
            max_model_len=joined.max_model_len,
            migration_group=compatibility_key(joined),
        )

    @classmethod
    def from_report(
        cls,
        report: LoadReport,
        joined: InstanceJoined | None = None,
        *,
        stream_seq: int = 0,
        num_pending: int = 0,
        pending_blocks: int = 0,
        terminating: bool = False,
        migration_group: str | None = None,
    ) -> InstanceLoad:
        """The view of a load report; ``joined`` supplies block size, model length and identity.

        ``terminating`` marks the instance terminating even if the report does not
        say so yet (the scheduler decided a scale-down the agent has not seen).
        ``migration_group`` saves recomputing :func:`compatibility_key` of ``joined``.
        """
        if migration_group is None:
            migration_group = "" if joined is None else compatibility_key(joined)
        return cls(
            instance_id=report.instance_id,
            num_total_blocks=report.num_total_blocks,
            block_size=16 if joined is None else joined.block_size,
            max_model_len=UNLIMITED_MODEL_LEN if joined is None else joined.max_model_len,
            migration_group=migration_group,
            running=report.running,
            num_reserved_blocks=report.num_reserved_blocks,
            head_of_line_demand=report.head_of_line_demand,
            head_of_line_priority=report.head_of_line_priority,
            waiting_demand=max(report.waiting_demand, report.head_of_line_demand),
            num_waiting=report.num_waiting,
            num_accepted=report.num_accepted,
            terminating=report.terminating or terminating,
            reported=True,
            report_seq=report.seq,
            stream_seq=stream_seq,
            reported_freeness=report.freeness,
            num_pending=num_pending,
            pending_blocks=pending_blocks,
            num_preemptions=report.num_preemptions,
            expected_growth_blocks=report.expected_growth_blocks,
            prefill_blocks=report.prefill_blocks,
            waiting_uncached_blocks=report.waiting_uncached_blocks,
        )

    @property
    def num_running(self) -> int:
        """Running requests the report counts (the batch, before pending dispatches)."""
        return sum(group.num_running for group in self.running)

    @property
    def queued_uncached_blocks(self) -> int:
        """Blocks of the queued prompts the instance's cache does not hold: the prefill work its queue
        brings (the whole queued demand where the report does not say)."""
        queued = max(self.waiting_demand, self.head_of_line_demand)
        if self.waiting_uncached_blocks < 0:
            return queued
        return min(self.waiting_uncached_blocks, queued)

    @property
    def num_used_blocks(self) -> int:
        """Physical blocks held by running requests."""
        return sum(group.num_blocks for group in self.running)

    def demand_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt of this many tokens needs on this instance."""
        return blocks_for_tokens(num_prompt_tokens, self.block_size)

    def can_ever_fit(self, num_prompt_tokens: int) -> bool:
        """Whether the prompt fits the model length and the whole block capacity at all."""
        return (
            num_prompt_tokens <= self.max_model_len
            and self.demand_blocks(num_prompt_tokens) <= self.num_total_blocks
        )

    def with_dispatch(self, num_blocks: int) -> InstanceLoad:
        """This view after one more dispatch of ``num_blocks`` demand that no report reflects yet."""
        return msgspec.structs.replace(
            self, num_pending=self.num_pending + 1, pending_blocks=self.pending_blocks + num_blocks
        )

    def as_terminating(self) -> InstanceLoad:
        return self if self.terminating else msgspec.structs.replace(self, terminating=True)


def _usage_and_batch(load: InstanceLoad, config: PolicyConfig) -> tuple[float, int]:
    """``(sum V, B)`` of the view, pending dispatches counted as admitted requests."""
    if load.terminating:
        return INFINITE_USAGE, load.num_running + load.num_pending
    used = load.num_reserved_blocks + load.head_of_line_demand + load.pending_blocks
    batch = load.num_pending
    seen_classes: list[object] = []
    for group in load.running:
        used += group.num_blocks
        if group.num_running > 0:
            batch += group.num_running
            cls = config.priority_class(group.priority)
            if cls.headroom_blocks and not any(cls is other for other in seen_classes):
                seen_classes.append(cls)
                used += cls.headroom_blocks
    return float(used), batch


def load_virtual_usage(load: InstanceLoad, config: PolicyConfig) -> float:
    """Sum of virtual usages, pending dispatches counted as admitted requests."""
    return _usage_and_batch(load, config)[0]


def load_batch_size(load: InstanceLoad) -> int:
    """``B``: running requests plus pending dispatches."""
    return load.num_running + load.num_pending


def load_freeness(load: InstanceLoad, config: PolicyConfig) -> float:
    """``F = (M - sum V) / B`` of the view (``-inf`` when terminating)."""
    usage, batch = _usage_and_batch(load, config)
    return (load.num_total_blocks - usage) / (batch if batch > 0 else 1)


def freeness_after_admit(load: InstanceLoad, demand_blocks: int, config: PolicyConfig) -> float:
    """The freeness the instance would have after admitting a request of this demand."""
    usage, batch = _usage_and_batch(load, config)
    return (load.num_total_blocks - usage - demand_blocks) / (batch + 1)


def room_blocks(load: InstanceLoad, config: PolicyConfig) -> int:
    """Blocks the instance could still take: capacity minus used, reserved, headroom and *every*
    queued and pending request's demand (0 when terminating or over-committed)."""
    if load.terminating:
        return 0
    usage, _ = _usage_and_batch(load, config)
    queued_rest = max(load.waiting_demand - load.head_of_line_demand, 0)
    return max(int(load.num_total_blocks - usage - queued_rest), 0)


def queue_aware_score(
    load: InstanceLoad,
    demand_blocks: int,
    config: PolicyConfig,
    *,
    priority: int = 0,
    blocks_ahead: bool = True,
    count_growth: bool = False,
    count_prefill: bool = False,
) -> float:
    """shoal's dispatch score: where the request would start soonest, then the most room per request.

    An instance where the request would wait scores minus the blocks ahead of it (negative),
    the larger of two bottlenecks, both in blocks: the prompts it waits to see prefilled (every
    request queued ahead of it plus the dispatches no report reflects yet; an engine prefills what
    it admits before it decodes), and the memory that must be freed before its queue and it fit
    (the deficit; INFaaS++'s load, shifted by the capacity). So once every instance queues, the
    least work ahead wins, counted in tokens, not requests (a queue of three long prompts is not
    as short as three short ones): where memory binds that is INFaaS++'s choice, where prefill
    binds (big memory, long prompts) the shortest prefill backlog.

    An instance where it would start at once (nothing queued ahead or pending, room for it)
    scores its freeness after admission with the whole queue counted (non-negative, above every
    instance where it would wait): ``(M - sum V - rest of the queue - demand) / (B + queued + 1)``
    (the paper's virtual usage counts only the head of line, so once every instance queues
    freeness stops seeing queue lengths; dividing by the batch spreads prefills and decode slots,
    which keeps TPOT low).

    The queue is served in priority order, so a request of a higher priority (a lower
    value) than the instance's head of line has nobody queued ahead of it: for it the
    queue counts neither as usage, nor as batch, nor as work ahead.

    ``count_growth`` (the ``blocks_ahead_growth`` rule) also takes the blocks the running requests
    are still expected to grow by (``expected_growth_blocks``, learned by the agent from finished
    requests) off the room: an instance whose decoding requests will soon fill it is not a place
    where the request starts at once (it would start, then be preempted or preempt them).

    ``count_prefill`` (the ``prefill_ahead`` rule) also counts the prompts the instance admitted but
    has not prefilled yet (``prefill_blocks``: the step in flight, a chunked prompt's rest) as work
    ahead wherever the request's memory fits: an engine that prefills every prompt it admits in one
    step starts the request only after that step, so an instance where it "starts at once" behind a
    long prefill ranks by that prefill against one that only decodes or whose queue is shorter.
    Where memory binds (a deficit) they are not counted: the request waits for blocks to be freed,
    and the prompts in flight are computed long before.

    ``blocks_ahead=False`` is the superseded ``queue_aware`` rule: a waiting
    instance scores only its memory deficit, and one with room scores its freeness even when
    prompts are queued ahead.
    """
    if load.terminating:
        return -INFINITE_USAGE
    room, queued, num_queued, batch = _room(load, demand_blocks, config, priority, count_growth=count_growth)
    if not blocks_ahead:
        if room < 0:
            return float(room)
        return room / (batch + num_queued + 1)
    work = queued + load.pending_blocks
    if count_prefill and room >= 0:  # where memory binds, the prompts in flight are done long before
        work += load.prefill_blocks
    ahead = max(work, -room)
    if ahead > 0:
        return -float(ahead)
    return room / (batch + num_queued + 1)


def _room(
    load: InstanceLoad, demand_blocks: int, config: PolicyConfig, priority: int, *, count_growth: bool = False
) -> tuple[float, int, int, int]:
    """``(room, queued demand, queued requests, batch)`` as :func:`queue_aware_score` reads them: the
    blocks left after the instance's usage, the queue ahead of the request and its demand."""
    usage, batch = _usage_and_batch(load, config)
    queued = max(load.waiting_demand, load.head_of_line_demand)
    num_queued = load.num_waiting
    if load.num_waiting > 0 and priority < load.head_of_line_priority:
        queued, num_queued = 0, 0
    room = load.num_total_blocks - (usage - load.head_of_line_demand) - queued - demand_blocks
    if count_growth:
        room -= load.expected_growth_blocks
    return room, queued, num_queued, batch


def waits_for_memory(
    load: InstanceLoad, demand_blocks: int, config: PolicyConfig, *, priority: int = 0
) -> bool:
    """Whether the request would wait on ``load`` for blocks to be freed (its queue and it do not fit)."""
    return load.terminating or _room(load, demand_blocks, config, priority)[0] < 0


def starts_at_once(
    load: InstanceLoad, demand_blocks: int, config: PolicyConfig, *, priority: int = 0
) -> bool:
    """Whether a request of this demand would start at once on ``load`` and stay: nothing queued
    ahead of it or pending, and room for it after the running requests' expected growth
    (:func:`queue_aware_score` with ``count_growth``, non-negative)."""
    return queue_aware_score(load, demand_blocks, config, priority=priority, count_growth=True) >= 0


def infaas_load(load: InstanceLoad) -> float:
    """INFaaS++ memory load as a share of capacity: used + reserved + every queued and pending demand.

    ``inf`` when terminating, so a draining instance is never the least loaded.
    """
    if load.terminating:
        return INFINITE_USAGE
    used = load.num_used_blocks + load.num_reserved_blocks + load.waiting_demand + load.pending_blocks
    return used / max(load.num_total_blocks, 1)


def load_scaling_freeness(load: InstanceLoad) -> float:
    """Freeness of normal usage (physical blocks of running requests only), for auto-scaling."""
    return freeness(load.num_total_blocks, float(load.num_used_blocks), load.num_running)
