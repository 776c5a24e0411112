"""What one simulation measured: per-request records, time series, and their summary.

Per request (:class:`RequestRecord`): arrival, first token, finish, output
tokens, preemptions and the time they cost, migrations. Summary
(:class:`SimResult`, the ``--json`` document):

* **TTFT**: arrival to first token, queuing included;
* **TPOT**: time per output token after the first, ``(finish - first) / (n - 1)``
  over requests with at least two output tokens;
* **end-to-end**: arrival to the last token; each as mean and P99;
* **preemptions** and **preemption loss**: for every preemption, the time from
  the step that preempted the request to the step that gave it its next token
  (queuing again plus recomputing), summed over requests;
* **fragmentation**: at each sample, the free blocks that sit on other
  instances while an instance's head-of-line request waits for lack of them,
  counted up to each such request's demand (and at most all free blocks), as a
  share of all cluster blocks; the mean over samples;
* **migrations** committed (and aborted, and started), the abort reasons
  (the source machine's, counted), the KV bytes copied, **churn** (the share
  of requests migrated more than 3 times), mean **downtime** of a committed
  migration (suspend on the source to admission at the destination);
* **rejected** requests (prompt beyond every instance's capacity), counted and as a
  share of all requests; they are in no latency metric, and ``warnings`` says so;
* **migrations per request**: the largest count (``max_migrations_per_request``)
  and how many requests moved 0, 1, 2, ... times (``migrations_per_request``);
* ``warnings``: what the run left out (a truncated trace, rejected requests);
* **instances_mean**: the time-average of instances held (launching, serving
  or draining), the cost when auto-scaling;
* **prefix-cache hit rate**: prompt tokens served from the engines' prefix cache
  when a request was first admitted, over all prompt tokens of the requests that
  got a first token; per run and per instance (the one that computed the prompt),
  with each instance's evictions of cached blocks.

Pure arithmetic over the records; no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from scheduler.config import PolicyConfig

__all__ = [
    "LATENCY_KEYS",
    "InstanceCacheSummary",
    "LatencySummary",
    "RequestRecord",
    "SimResult",
    "fragmentation_share",
    "summarize",
    "summarize_latency",
]

LATENCY_KEYS = ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2e_mean_s", "e2e_p99_s")
CHURN_THRESHOLD = 3


class RequestRecord:
    """Mutable per-request measurements, filled in by the simulator as events happen."""

    __slots__ = (
        "arrival_s",
        "finish_s",
        "first_token_s",
        "num_cached_tokens",
        "num_migrations",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "preempted_at_s",
        "preemption_loss_s",
        "priority",
    )

    def __init__(self, arrival_s: float, priority: int) -> None:
        self.arrival_s = arrival_s
        self.priority = priority
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.preempted_at_s = -1.0
        self.preemption_loss_s = 0.0
        self.num_migrations = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache at first admission


class LatencySummary(msgspec.Struct, frozen=True, kw_only=True):
    """Mean and P99 of TTFT, time per output token and end-to-end latency, in seconds."""

    count: int
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float


class InstanceCacheSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's prefix cache: the prompt tokens it computed or found cached, and evictions."""

    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    evictions: int


def _mean_p99(values: np.ndarray) -> tuple[float, float]:
    if values.size == 0:
        return 0.0, 0.0
    return float(values.mean()), float(np.percentile(values, 99))


def summarize_latency(records: Sequence[RequestRecord]) -> LatencySummary:
    """Latency summary of the finished requests among ``records``."""
    done = [r for r in records if r.finish_s >= 0]
    ttft = np.fromiter((r.first_token_s - r.arrival_s for r in done), dtype=float, count=len(done))
    e2e = np.fromiter((r.finish_s - r.arrival_s for r in done), dtype=float, count=len(done))
    decoding = [r for r in done if r.num_output_tokens > 1]
    tpot = np.fromiter(
        ((r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in decoding),
        dtype=float, count=len(decoding),
    )
    ttft_mean, ttft_p99 = _mean_p99(ttft)
    tpot_mean, tpot_p99 = _mean_p99(tpot)
    e2e_mean, e2e_p99 = _mean_p99(e2e)
    return LatencySummary(
        count=len(done), ttft_mean_s=ttft_mean, ttft_p99_s=ttft_p99, tpot_mean_s=tpot_mean,
        tpot_p99_s=tpot_p99, e2e_mean_s=e2e_mean, e2e_p99_s=e2e_p99,
    )


def fragmentation_share(
    free_blocks: Sequence[int], head_of_line_demand: Sequence[int], total_blocks: int
) -> float:
    """Free blocks stranded on other instances while heads of line wait for lack of them.

    ``head_of_line_demand[i]`` is the blocks instance ``i``'s queue head needs
    (0 if none, or if it is not waiting for blocks). Each blocked head counts
    the free blocks elsewhere up to its demand; the sum is capped at all free
    blocks; the result is a share of ``total_blocks``.
    """
    if total_blocks <= 0:
        return 0.0
    free_total = sum(free_blocks)
    stranded = 0
    for free, demand in zip(free_blocks, head_of_line_demand, strict=True):
        if demand > free:
            stranded += min(demand, free_total - free)
    return min(stranded, free_total) / total_blocks


class SimResult(msgspec.Struct, kw_only=True):
    """The summary of one run (the ``--json`` document) plus its time series."""

    policy: str
    workload: str
    credit: str = ""
    num_requests: int
    num_finished: int
    num_instances: int
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p99_s: float
    e2e_mean_s: float
    e2e_p99_s: float
    ttft_p50_s: float
    tpot_p50_s: float = 0.0
    #: the service-level objective the run was judged by (``SimConfig.slo``): TTFT and TPOT bounds
    slo_ttft_s: float = 0.0
    slo_tpot_s: float = 0.0
    #: share of all requests (rejected ones included) that finished within both SLO bounds
    slo_attainment: float = 0.0
    preemptions: int
    preemption_loss_s: float
    fragmentation_mean: float
    migrations: int
    migrations_aborted: int
    migration_downtime_mean_s: float
    migrations_started: int = 0
    migration_abort_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    migration_bytes: int = 0
    #: KV bytes a migration's destination already cached (leading blocks of the chain not copied)
    migration_bytes_saved: int = 0
    #: ``migration_bytes / migrations`` (bytes copied per committed migration)
    migration_bytes_per_migration: float = 0.0
    #: ``migration_bytes_saved / (migration_bytes + migration_bytes_saved)``
    migration_saved_share: float = 0.0
    #: the busiest instance's running requests over the mean instance's (averaged over the sample
    #: ticks; 1: even spread)
    running_max_over_mean: float = 0.0
    #: TTFT P99 of the requests opening with the workload's hot prompt (the most common first
    #: segment, when a tenth of the requests and twice the mean segment's share open with it; 0: none)
    hot_prefix_ttft_p99_s: float = 0.0
    #: stage copies paced (``MigrationConfig.copy_step_share``), and of those the ones that hurried
    paced_copies: int = 0
    hurried_copies: int = 0
    churn: float
    rejected: int
    rejected_share: float = 0.0
    max_migrations_per_request: int = 0
    migrations_per_request: dict[str, int] = msgspec.field(default_factory=dict)
    requeues: int = 0
    warnings: list[str] = msgspec.field(default_factory=list)
    instances_mean: float
    prefix_cache: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: ``cached_tokens / prompt_tokens``
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_by_instance: dict[str, InstanceCacheSummary] = msgspec.field(default_factory=dict)
    virtual_s: float
    wall_s: float
    by_priority: dict[str, LatencySummary]
    fragmentation_series: list[tuple[float, float]] = msgspec.field(default_factory=list)
    instances_series: list[tuple[float, int]] = msgspec.field(default_factory=list)
    parameters: dict[str, object] = msgspec.field(default_factory=dict)

    def to_dict(self, *, series: bool = True) -> dict[str, object]:
        data = msgspec.to_builtins(self)
        if not series:
            data.pop("fragmentation_series", None)
            data.pop("instances_series", None)
        return data  # type: ignore[no-any-return]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _tpot(record: RequestRecord) -> float:
    return (record.finish_s - record.first_token_s) / (record.num_output_tokens - 1)


def _tpot_p50(done: Sequence[RequestRecord]) -> float:
    tpot = [_tpot(r) for r in done if r.num_output_tokens > 1]
    return float(np.percentile(tpot, 50)) if tpot else 0.0


def _max_over_mean(samples: dict[str, int]) -> float:
    values = list(samples.values())
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 0.0


def _hot_ttft_p99(records: Sequence[RequestRecord], ids: Sequence[str], groups: dict[str, int]) -> float:
    if not groups:
        return 0.0
    hot = [
        r.first_token_s - r.arrival_s
        for r, request_id in zip(records, ids, strict=True)
        if request_id in groups and r.first_token_s >= 0
    ]
    return float(np.percentile(hot, 99)) if hot else 0.0


def slo_attainment(records: Sequence[RequestRecord], ttft_s: float, tpot_s: float) -> float:
    """The share of ``records`` that finished with TTFT <= ``ttft_s`` and TPOT <= ``tpot_s`` (a
    one-token answer has no TPOT); a rejected or unfinished request misses."""
    if not records:
        return 0.0
    met = sum(
        1 for r in records
        if r.finish_s >= 0 and r.first_token_s - r.arrival_s <= ttft_s
        and (r.num_output_tokens <= 1 or _tpot(r) <= tpot_s)
    )
    return met / len(records)


def summarize(
    *,
    records: Sequence[RequestRecord],
    policy: PolicyConfig,
    policy_name: str,
    workload: str,
    credit: str,
    num_instances: int,
    rejected: int,
    migrations: int,
    migrations_aborted: int,
    downtime_total_s: float,
    migrations_started: int = 0,
    migration_abort_reasons: dict[str, int] | None = None,
    migration_bytes: int = 0,
    migration_bytes_saved: int = 0,
    paced_copies: int = 0,
    hurried_copies: int = 0,
    fragmentation_series: list[tuple[float, float]],
    instances_series: list[tuple[float, int]],
    instance_seconds: float,
    virtual_s: float,
    wall_s: float,
    parameters: dict[str, object],
    warnings: Sequence[str] = (),
    requeues: int = 0,
    prefix_cache: bool = False,
    prompt_tokens_by_instance: dict[str, list[int]] | None = None,
    evictions_by_instance: dict[str, int] | None = None,
    slo: tuple[float, float] | None = None,
    running_samples: dict[str, int] | None = None,
    prefix_groups: dict[str, int] | None = None,
    record_ids: Sequence[str] = (),
) -> SimResult:
    """Fold the per-request records and series into a :class:`SimResult`; with ``slo`` (TTFT and
    TPOT bounds, seconds) the share of requests within both (:func:`slo_attainment`)."""
    overall = summarize_latency(records)
    done = [r for r in records if r.finish_s >= 0]
    ttft = np.fromiter((r.first_token_s - r.arrival_s for r in done), dtype=float, count=len(done))
    by_class: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_class.setdefault(policy.priority_class(record.priority).name, []).append(record)
    frag = [v for _, v in fragmentation_series]
    churned = sum(1 for r in records if r.num_migrations > CHURN_THRESHOLD)
    moves: dict[int, int] = {}
    for record in records:
        moves[record.num_migrations] = moves.get(record.num_migrations, 0) + 1
    started = [r for r in records if r.first_token_s >= 0]
    prompt_tokens = sum(r.num_prompt_tokens for r in started)
    cached_tokens = sum(r.num_cached_tokens for r in started)
    by_instance = prompt_tokens_by_instance or {}
    evictions = evictions_by_instance or {}
    cache_by_instance = {
        instance_id: InstanceCacheSummary(
            prompt_tokens=by_instance.get(instance_id, [0, 0])[0],
            cached_tokens=by_instance.get(instance_id, [0, 0])[1],
            hit_rate=_share(*by_instance.get(instance_id, [0, 0])[::-1]),
            evictions=evictions.get(instance_id, 0),
        )
        for instance_id in sorted({*by_instance, *evictions})
    }
    notes = list(warnings)
    if rejected:
        notes.append(
            f"{rejected} of {len(records)} requests ({100 * rejected / max(len(records), 1):.2f}%) rejected: "
            "prompt beyond every instance's capacity; they are in no latency metric"
        )
    return SimResult(
        policy=policy_name,
        workload=workload,
        credit=credit,
        num_requests=len(records),
        num_finished=overall.count,
        num_instances=num_instances,
        ttft_mean_s=overall.ttft_mean_s,
        ttft_p99_s=overall.ttft_p99_s,
        tpot_mean_s=overall.tpot_mean_s,
        tpot_p99_s=overall.tpot_p99_s,
        e2e_mean_s=overall.e2e_mean_s,
        e2e_p99_s=overall.e2e_p99_s,
        ttft_p50_s=float(np.percentile(ttft, 50)) if ttft.size else 0.0,
        tpot_p50_s=_tpot_p50(done),
        slo_ttft_s=slo[0] if slo else 0.0,
        slo_tpot_s=slo[1] if slo else 0.0,
        slo_attainment=slo_attainment(records, *slo) if slo else 0.0,
        preemptions=sum(r.num_preemptions for r in records),
        preemption_loss_s=sum(r.preemption_loss_s for r in records),
        fragmentation_mean=float(np.mean(frag)) if frag else 0.0,
        migrations=migrations,
        migrations_aborted=migrations_aborted,
        migration_downtime_mean_s=downtime_total_s / migrations if migrations else 0.0,
        migrations_started=migrations_started,
        migration_abort_reasons={} if migration_abort_reasons is None else migration_abort_reasons,
        migration_bytes=migration_bytes,
        migration_bytes_saved=migration_bytes_saved,
        migration_bytes_per_migration=migration_bytes / migrations if migrations else 0.0,
        migration_saved_share=_share(migration_bytes_saved, migration_bytes + migration_bytes_saved),
        running_max_over_mean=_max_over_mean(running_samples or {}),
        hot_prefix_ttft_p99_s=_hot_ttft_p99(records, record_ids, prefix_groups or {}),
        paced_copies=paced_copies,
        hurried_copies=hurried_copies,
        churn=churned / len(records) if records else 0.0,
        rejected=rejected,
        rejected_share=rejected / len(records) if records else 0.0,
        max_migrations_per_request=max(moves, default=0),
        migrations_per_request={str(k): moves[k] for k in sorted(moves)},
        requeues=requeues,
        warnings=notes,
        instances_mean=instance_seconds / virtual_s if virtual_s > 0 else float(num_instances),
        prefix_cache=prefix_cache,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        prefix_cache_hit_rate=_share(cached_tokens, prompt_tokens),
        prefix_cache_by_instance=cache_by_instance,
        virtual_s=virtual_s,
        wall_s=wall_s,
        by_priority={name: summarize_latency(rs) for name, rs in sorted(by_class.items())},
        fragmentation_series=fragmentation_series,
        instances_series=instances_series,
        parameters=parameters,
    )
