"""The cache-aware dispatch rules choose as documented on hand-built loads with cached prompts.

``kv`` (NVIDIA Dynamo's KV router) sends a request to the instance caching its prompt until that
instance's decode blocks outweigh the prefill it saves; ``prefix`` (llm-d's scorers) by the weighted
sum of prefix share, queue and KV utilisation; ``predicted_ttft`` (shoal's cost model) keeps a hot
prefix where it is cached until the predicted wait there exceeds prefilling it again elsewhere, and
then spreads it. The rankings kept across decisions choose exactly what a scan of every instance
chooses.
"""

from __future__ import annotations

import functools
import random
from typing import TypeVar

import msgspec
import pytest

from scheduler.config import CacheCostConfig, DispatchPolicy, PolicyConfig, decode_policy, encode_policy
from scheduler.policy import InstanceLoad, PendingRequest, dispatch_pending, make_dispatcher
from scheduler.policy.cache_cost import predicted_ttft_key, ttft_terms
from scheduler.policy.cost_ranking import best_kv_by_scan, best_ttft_by_scan
from scheduler.policy.dispatch import requeue_choice, requeue_request
from schemas.load import PriorityLoad

CONFIG = PolicyConfig()
T = TypeVar("T", InstanceLoad, PendingRequest)
SYSTEM_PROMPT = 6000  # tokens: 375 blocks of 16
PROMPT = SYSTEM_PROMPT + 64  # 379 blocks


def load(
    instance_id: str, used: int = 0, running: int = 0, total: int = 2000, **extra: object
) -> InstanceLoad:
    groups = (PriorityLoad(priority=0, num_running=running, num_blocks=used),) if running else ()
    return InstanceLoad(
        instance_id=instance_id,
        num_total_blocks=total,
        running=groups,
        reported=True,
        **extra,  # type: ignore[arg-type]
    )


def choose(
    policy: DispatchPolicy,
    loads: list[InstanceLoad],
    cached: dict[str, int],
    tokens: int = PROMPT,
    config: PolicyConfig = CONFIG,
    **kw: object,
) -> str | None:
    fields: dict[str, object] = {"request_id": "r", **kw}
    request = PendingRequest(num_prompt_tokens=tokens, cached_tokens=tuple(cached.items()), **fields)  # type: ignore[arg-type]
    decision = make_dispatcher(policy, config).choose(request, loads)
    return None if decision is None else decision.instance_id


# -- kv: Dynamo's cost w * prefill blocks + decode blocks --------------------------------------------


@pytest.mark.parametrize(
    ("hot_used", "chosen"),
    [
        # the hot instance saves 375 prefill blocks; it wins while its extra decode blocks are fewer
        (0, "hot"),
        (300, "hot"),
        (374, "hot"),
        (375, "cold"),  # a tie: cost equal, the smaller id ("cold") wins
        (500, "cold"),
    ],
)
def test_kv_picks_the_cached_instance_until_its_decode_blocks_outweigh_the_prefill_saved(
    hot_used: int, chosen: str
) -> None:
    loads = [load("hot", used=hot_used, running=4), load("cold", running=0)]
    assert choose(DispatchPolicy.KV, loads, {"hot": SYSTEM_PROMPT}) == chosen


def test_kv_weight_zero_ignores_the_cache() -> None:
    config = PolicyConfig(cache=CacheCostConfig(kv_overlap_weight=0.0))
    loads = [load("hot", used=10, running=1), load("cold")]
    assert choose(DispatchPolicy.KV, loads, {"hot": SYSTEM_PROMPT}, config=config) == "cold"
    assert choose(DispatchPolicy.KV, loads, {"hot": SYSTEM_PROMPT}) == "hot"


def test_kv_at_a_temperature_draws_the_same_instance_for_the_same_inputs() -> None:
    config = PolicyConfig(cache=CacheCostConfig(kv_temperature=1.0))
    loads = [load(f"i{k}", used=20 * k, running=k) for k in range(8)]
    picks = [choose(DispatchPolicy.KV, loads, {}, config=config, request_id=f"r{n}") for n in range(64)]
    assert picks == [
        choose(DispatchPolicy.KV, loads, {}, config=config, request_id=f"r{n}") for n in range(64)
    ]
    assert len(set(picks)) > 1  # spread, where temperature 0 always takes i0
    assert {choose(DispatchPolicy.KV, loads, {}, request_id=f"r{n}") for n in range(64)} == {"i0"}


# -- prefix: llm-d's 3 x prefix + 2 x queue + 2 x KV utilisation ------------------------------------


@pytest.mark.parametrize(
    ("hot", "cold", "chosen"),
    [
        # equal queues and memory: the prefix score decides
        ({}, {}, "hot"),
        # hot queues 4, cold none: queue score 0 against 1 (-2), the prefix 375/379 of 3 (+2.97) wins
        ({"num_waiting": 4}, {}, "hot"),
        # and with 90% of its KV in use as well (-1.8): 2.97 + 0.2 < 4, the cold one
        ({"num_waiting": 4, "used": 1800, "running": 20}, {}, "cold"),
    ],
)
def test_prefix_weighs_prefix_share_queue_and_kv_utilisation(
    hot: dict[str, int], cold: dict[str, int], chosen: str
) -> None:
    loads = [load("hot", **hot), load("cold", **cold)]
    assert choose(DispatchPolicy.PREFIX, loads, {"hot": SYSTEM_PROMPT}) == chosen


# -- predicted_ttft: shoal's cost model --------------------------------------------------------------


def test_predicted_ttft_equals_prefill_ahead_without_cached_prompts() -> None:
    rng = random.Random(7)
    for _ in range(300):
        loads = [
            msgspec_replace(_random_load(rng, f"i{k:02d}"), waiting_uncached_blocks=-1)
            for k in range(rng.randint(1, 12))
        ]
        tokens = rng.randint(1, 3000)
        request = PendingRequest(request_id="r", num_prompt_tokens=tokens, priority=rng.choice((0, 0, -1)))
        ours = make_dispatcher(DispatchPolicy.PREDICTED_TTFT, CONFIG).choose(request, loads)
        theirs = make_dispatcher(DispatchPolicy.PREFILL_AHEAD, CONFIG).choose(request, loads)
        assert (ours and ours.instance_id) == (theirs and theirs.instance_id)


@pytest.mark.parametrize(
    ("queued_uncached", "chosen"),
    [
        # the cost of prefilling the 379 blocks on the idle instance: 379 for its TTFT and 379 more for the
        # decode steps its prefill stretches; on the hot one its queue's uncached blocks, then 2 x 4
        (200, "hot"),
        (749, "hot"),
        # 750 + 8 = 758: a tie with prefilling the whole prompt on the idle instance, whose room wins
        (750, "idle"),
        (900, "idle"),
    ],
)
def test_predicted_ttft_spreads_a_hot_prefix_once_the_wait_exceeds_a_prefill_elsewhere(
    queued_uncached: int, chosen: str
) -> None:
    # the hot instance's queue: 10 requests of the hot prefix (3,790 blocks of demand, mostly cached)
    hot = load(
        "hot",
        used=1000,
        running=10,
        total=8000,
        num_waiting=10,
        waiting_demand=3790,
        head_of_line_demand=379,
        waiting_uncached_blocks=queued_uncached,
    )
    idle = load("idle", used=1000, running=10, total=8000)  # as busy: no herding
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, idle], {"hot": SYSTEM_PROMPT}) == chosen


def test_predicted_ttft_counts_the_whole_queue_where_the_report_does_not_say_what_is_cached() -> None:
    hot = load(
        "hot", used=1000, running=10, total=8000, num_waiting=10, waiting_demand=3790, head_of_line_demand=379
    )
    idle = load("idle", used=1000, running=10, total=8000)  # as busy: no herding
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, idle], {"hot": SYSTEM_PROMPT}) == "idle"
    told = msgspec_replace(hot, waiting_uncached_blocks=40)
    assert choose(DispatchPolicy.PREDICTED_TTFT, [told, idle], {"hot": SYSTEM_PROMPT}) == "hot"


def test_predicted_ttft_without_the_decode_cost_spreads_at_the_ttft_alone() -> None:
    config = PolicyConfig(cache=CacheCostConfig(added_prefill_weight=0.0))
    hot = load(
        "hot",
        used=1000,
        running=10,
        total=8000,
        num_waiting=10,
        waiting_demand=3790,
        head_of_line_demand=379,
        waiting_uncached_blocks=400,
    )
    idle = load("idle", used=1000, running=10, total=8000)  # as busy: no herding
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, idle], {"hot": SYSTEM_PROMPT}) == "hot"  # 408 < 758
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, idle], {"hot": SYSTEM_PROMPT}, config=config) == "idle"


def test_predicted_ttft_a_burst_of_one_hot_prefix_spreads_over_instances() -> None:
    """Dispatches no report reflects yet count whole: a burst fills the cached instance first, then
    the cost of waiting there passes a prefill elsewhere and the burst spreads."""
    loads = [load("hot", total=8000), *(load(f"other{k}", total=8000) for k in range(3))]
    requests = [
        PendingRequest(
            request_id=f"r{n}",
            num_prompt_tokens=PROMPT,
            arrival=float(n),
            cached_tokens=(("hot", SYSTEM_PROMPT),),
        )
        for n in range(8)
    ]
    placed = [
        d.instance_id for d in dispatch_pending(requests, loads, make_dispatcher("predicted_ttft")).decisions
    ]
    assert placed[0] == "hot" and set(placed) == {"hot", "other0", "other1", "other2"}


def test_predicted_ttft_high_priority_skips_the_queue_and_keeps_its_headroom() -> None:
    # both instances queue 300 blocks of normal requests; a high-priority request skips the queue
    busy = load("busy", used=600, running=6, num_waiting=3, waiting_demand=300, head_of_line_demand=100)
    # running a high-priority request, this instance reserves its class's 100 blocks of headroom
    high = InstanceLoad(
        instance_id="high",
        num_total_blocks=2000,
        reported=True,
        running=(
            PriorityLoad(priority=-1, num_running=1, num_blocks=500),
            PriorityLoad(priority=0, num_running=5, num_blocks=500),
        ),
        num_waiting=3,
        waiting_demand=300,
        head_of_line_demand=100,
    )
    assert choose(DispatchPolicy.PREDICTED_TTFT, [busy, high], {}, tokens=320, priority=-1) == "busy"
    assert ttft_terms(high, CONFIG, -1).room == ttft_terms(busy, CONFIG, -1).room - 400 - 100


# -- the rankings kept across decisions choose what a full scan chooses ------------------------------


def _random_load(rng: random.Random, instance_id: str) -> InstanceLoad:
    total = rng.choice((400, 1000, 2000))
    running = rng.randint(0, 12)
    used = min(rng.randint(0, total), 40 * running) if running else 0
    waiting = rng.choice((0, 0, rng.randint(1, 5)))
    demand = rng.randint(waiting, 80 * waiting)
    return load(
        instance_id,
        used=used,
        running=running,
        total=total,
        num_waiting=waiting,
        waiting_demand=demand,
        head_of_line_demand=min(demand, rng.randint(1, 80)) if waiting else 0,
        head_of_line_priority=rng.choice((0, 0, 1)),
        waiting_uncached_blocks=rng.choice((-1, rng.randint(0, demand))),
        prefill_blocks=rng.choice((0, rng.randint(0, 100))),
        num_pending=(pending := rng.randint(0, 2)),
        pending_blocks=pending * rng.randint(0, 50),
        terminating=rng.random() < 0.05,
    )


@pytest.mark.parametrize("policy", [DispatchPolicy.PREDICTED_TTFT, DispatchPolicy.KV])
def test_a_kept_ranking_chooses_what_a_scan_of_every_instance_chooses(policy: DispatchPolicy) -> None:
    rng = random.Random(11)
    dispatcher = make_dispatcher(policy, CONFIG)  # kept across every decision below
    loads = [_random_load(rng, f"i{k:03d}") for k in range(60)]
    for n in range(400):
        for _ in range(rng.choice((0, 1, 1, 2, 30))):  # new reports: a few views, now and then most
            k = rng.randrange(len(loads))
            loads[k] = _random_load(rng, loads[k].instance_id)
        tokens = rng.randint(1, 4000)
        holders = rng.sample(loads, rng.randint(0, 5))
        cached = {h.instance_id: 16 * rng.randint(1, max(tokens // 16, 1)) for h in holders}
        request = PendingRequest(
            request_id=f"r{n}",
            num_prompt_tokens=tokens,
            priority=rng.choice((0, 0, -1)),
            cached_tokens=tuple(cached.items()),
            exclude=tuple(rng.sample([ld.instance_id for ld in loads], rng.randint(0, 2))),
        )
        decision = dispatcher.choose(request, loads)

        def eligible(view: InstanceLoad, request: PendingRequest = request) -> bool:
            return (
                not view.terminating
                and view.demand_blocks(request.num_prompt_tokens) <= view.num_total_blocks
                and view.instance_id not in request.exclude
            )

        if policy is DispatchPolicy.KV:
            expected = best_kv_by_scan(loads, tokens, cached, eligible, CONFIG)
        else:
            expected = best_ttft_by_scan(
                loads,
                functools.partial(InstanceLoad.demand_blocks, num_prompt_tokens=tokens),
                {i: c // 16 for i, c in cached.items()},
                eligible,
                CONFIG,
                request.priority,
            )
        assert (decision and (decision.instance_id, decision.score)) == (
            expected and (expected[0], expected[1][0])
        )
        if decision is not None:  # the dispatch shows in the next decision's views
            k = next(i for i, ld in enumerate(loads) if ld.instance_id == decision.instance_id)
            loads[k] = loads[k].with_dispatch(decision.demand_blocks)


def test_predicted_ttft_key_reads_prefill_in_flight_only_where_memory_fits() -> None:
    terms = ttft_terms(load("a", used=900, running=3, total=1000, prefill_blocks=50), CONFIG, 0)
    assert predicted_ttft_key(terms, 80) == (-130.0, float("-inf"))  # room 20 after: waits for 50 in flight
    assert predicted_ttft_key(terms, 150) == (-200.0, float("-inf"))  # 50 short: waits for memory


def msgspec_replace(view: T, **changes: object) -> T:
    return msgspec.structs.replace(view, **changes)


# -- moving a queued request under the cost model -----------------------------------------------------

TTFT_CONFIG = PolicyConfig(dispatch_policy=DispatchPolicy.PREDICTED_TTFT)


@pytest.mark.parametrize(
    ("source_uncached", "cached", "moved_to"),
    [
        # the source's queue (the request and one ahead of it) is all cached there: 8 blocks to prefill
        # and 4 of its own, against 2 x 379 on an idle instance: it stays
        (8, {"source": SYSTEM_PROMPT}, None),
        # nothing of the queue is cached at the source (758 + 379): the idle instance costs 2 x 379
        (758, {}, "idle"),
        # and an idle instance caching the prompt beats the one that does not (2 x 4 against 2 x 379)
        (758, {"warm": SYSTEM_PROMPT}, "warm"),
    ],
)
def test_predicted_ttft_moves_a_queued_request_only_where_its_predicted_ttft_is_lower(
    source_uncached: int, cached: dict[str, int], moved_to: str | None
) -> None:
    source = load(
        "source",
        used=1000,
        running=10,
        num_waiting=2,
        waiting_demand=758,
        head_of_line_demand=379,
        waiting_uncached_blocks=source_uncached,
    )
    loads = [source, load("idle"), load("warm")]
    request = PendingRequest(request_id="q", num_prompt_tokens=PROMPT, cached_tokens=tuple(cached.items()))
    dispatcher = make_dispatcher(DispatchPolicy.PREDICTED_TTFT, TTFT_CONFIG)
    decision = requeue_choice(dispatcher, request, "source", loads, config=TTFT_CONFIG)
    assert (decision and decision.instance_id) == moved_to


def test_predicted_ttft_a_cached_prompt_needs_no_room_where_it_is_cached() -> None:
    # 100 blocks of room left after the running requests' expected growth: the 379-block prompt does
    # not start there at once, its 4 uncached blocks do
    tight = load("tight", used=1800, running=10, expected_growth_blocks=100)
    source = load("source", used=1000, running=10, num_waiting=1, waiting_demand=379, head_of_line_demand=379)
    request = PendingRequest(request_id="q", num_prompt_tokens=PROMPT)
    assert "tight" in requeue_request(request, "source", [source, tight], TTFT_CONFIG).exclude
    cached = msgspec_replace(request, cached_tokens=(("tight", SYSTEM_PROMPT),))
    assert "tight" not in requeue_request(cached, "source", [source, tight], TTFT_CONFIG).exclude
    decision = requeue_choice(
        make_dispatcher(DispatchPolicy.PREDICTED_TTFT, TTFT_CONFIG),
        cached,
        "source",
        [source, tight],
        config=TTFT_CONFIG,
    )
    assert decision is not None and decision.instance_id == "tight"


def test_instances_of_different_block_sizes_are_each_rated_in_their_own_blocks() -> None:
    # 6,064 tokens: 379 blocks of 16 on "small", 190 of 32 on "large"; "small" caches 6,000 of them
    small = load("small", used=400, running=4, total=4000)
    large = msgspec_replace(load("large", used=200, running=4, total=4000), block_size=32)
    dispatcher = make_dispatcher(DispatchPolicy.PREDICTED_TTFT, CONFIG)
    request = PendingRequest(
        request_id="r", num_prompt_tokens=PROMPT, cached_tokens=(("small", SYSTEM_PROMPT),)
    )
    decision = dispatcher.choose(request, (small, large))  # any sequence of views
    assert decision is not None and (decision.instance_id, decision.score) == ("small", -8.0)
    cold = dispatcher.choose(msgspec_replace(request, cached_tokens=()), (small, large))
    assert cold is not None and (cold.instance_id, cold.score) == ("large", -380.0)


@pytest.mark.parametrize(
    ("hot_running", "chosen"),
    [
        # the mean batch after this request: (hot + 3 x 2 + 1) / 4; the hot instance keeps its cache's
        # advantage while its batch is below twice that (minus the request itself)
        (4, "hot"),  # limit 2 x 11 / 4 - 1 = 4.5
        (5, "hot"),  # limit 5
        (6, "other0"),  # limit 5.5: rated as caching nothing, and the others have more room per request
        (12, "other0"),
    ],
)
def test_predicted_ttft_spreads_a_hot_prefix_whose_instance_runs_twice_the_mean(
    hot_running: int, chosen: str
) -> None:
    hot = load("hot", used=40 * hot_running, running=hot_running, total=8000)
    others = [load(f"other{k}", used=80, running=2, total=8000) for k in range(3)]
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, *others], {"hot": SYSTEM_PROMPT}) == chosen
    off = PolicyConfig(cache=CacheCostConfig(herd_factor=0.0))
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, *others], {"hot": SYSTEM_PROMPT}, config=off) == "hot"


@pytest.mark.parametrize(
    ("hot_running", "others_running", "min_batch", "chosen"),
    [
        # light load, the others idle: the mean batch after this request is (hot + 1) / 4, below one,
        # and twice it is passed by a single request; the guard waits for a batch of 2
        (1, 0, 2, "hot"),  # starts at once from its cache beside one request
        (1, 0, 1, "other0"),  # the factor alone: a batch of 1 > 2 x 2 / 4 - 1 = 0, prefilled again
        (2, 0, 2, "other0"),  # a batch of 2 over twice the mean: the hot prefix spreads
        (3, 0, 2, "other0"),
        # at load the floor is below twice the mean and the factor decides, as before
        (5, 2, 2, "hot"),  # limit 2 x 12 / 4 - 1 = 5
        (6, 2, 2, "other0"),  # limit 5.5
        (12, 2, 2, "other0"),
    ],
)
def test_predicted_ttft_herding_guard_leaves_a_light_load_on_the_cached_instance(
    hot_running: int, others_running: int, min_batch: int, chosen: str
) -> None:
    config = PolicyConfig(cache=CacheCostConfig(herd_min_batch=min_batch))
    hot = load("hot", used=40 * hot_running, running=hot_running, total=8000)
    others = [
        load(f"other{k}", used=40 * others_running, running=others_running, total=8000) for k in range(3)
    ]
    cached = {"hot": SYSTEM_PROMPT}
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, *others], cached, config=config) == chosen
    # the scan of every instance (instances of several block sizes) rates them the same way
    scanned = best_ttft_by_scan(
        [hot, *others],
        functools.partial(InstanceLoad.demand_blocks, num_prompt_tokens=PROMPT),
        {"hot": SYSTEM_PROMPT // 16},
        lambda view: True,
        config,
        0,
    )
    assert scanned is not None and scanned[0] == chosen


def test_a_policy_recorded_without_the_guards_batch_floor_replays_with_the_factor_alone() -> None:
    recorded = encode_policy(PolicyConfig(dispatch_policy=DispatchPolicy.PREDICTED_TTFT))
    assert decode_policy(recorded).cache.herd_min_batch == 2
    older = recorded.replace(',"herd_min_batch":2', "")
    assert "herd_min_batch" not in older
    assert decode_policy(older).cache == CacheCostConfig(herd_min_batch=0)
    hot = load("hot", used=40, running=1, total=8000)
    others = [load(f"other{k}", total=8000) for k in range(3)]
    assert choose(DispatchPolicy.PREDICTED_TTFT, [hot, *others], {"hot": SYSTEM_PROMPT}) == "hot"
    assert (
        choose(
            DispatchPolicy.PREDICTED_TTFT, [hot, *others], {"hot": SYSTEM_PROMPT}, config=decode_policy(older)
        )
        == "other0"
    )
