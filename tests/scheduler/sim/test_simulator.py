"""The simulator end to end: requests finish, migrations move them, preemptions and rejections count."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.engines.profile import load_profile
from scheduler.config import SHOAL_REQUEUE_AFTER_S, DispatchPolicy, PairingConfig, ScalingConfig
from scheduler.sim.config import MigrationModel, SimConfig, policy_setup
from scheduler.sim.metrics import CHURN_THRESHOLD, fragmentation_share
from scheduler.sim.simulator import Simulator, simulate
from scheduler.sim.workload import SimRequest, Workload, synthetic_workload, with_priorities
from tests.scheduler.sim.overloaded import PaperRun

TINY = load_profile("tiny-test")  # 64 blocks x 4 tokens


def _workload(*requests: tuple[float, int, int], priority: int = 0) -> Workload:
    return Workload(
        requests=tuple(
            SimRequest(request_id=f"r{k}", arrival_s=a, num_prompt_tokens=p, num_output_tokens=o,
                       priority=priority)
            for k, (a, p, o) in enumerate(requests)
        ),
        description="hand-made",
    )


def test_every_request_finishes_with_its_output_length_and_sane_latencies() -> None:
    workload = synthetic_workload(100, 3.0, mix="M-M", seed=4)
    sim = Simulator(SimConfig(setup=policy_setup("shoal"), num_instances=4), workload)
    result = sim.run()
    assert result.num_finished == 100 and result.rejected == 0
    for request in workload.requests:
        record = sim.records[request.request_id]
        assert record.num_output_tokens == request.num_output_tokens
        assert record.arrival_s < record.first_token_s <= record.finish_s
    assert 0 < result.ttft_mean_s <= result.ttft_p99_s
    # the profile's decode step is 23-60 ms: time per output token lies around it
    assert 0.02 < result.tpot_mean_s < 0.2
    assert result.instances_mean == pytest.approx(4.0)


def test_a_run_is_deterministic(overloaded_paper_run: PaperRun) -> None:
    # a run with migrations (committed and aborted), preemptions and queues, made again
    first = overloaded_paper_run
    assert first.result.migrations and first.result.migrations_aborted and first.result.preemptions
    again = simulate(first.config, first.workload)
    assert first.result.to_dict(series=True) | {"wall_s": 0} == again.to_dict(series=True) | {"wall_s": 0}


def test_prompts_beyond_capacity_are_rejected_and_counted() -> None:
    workload = _workload((0.0, 100, 5), (0.1, 300, 5), (0.2, 50, 5))  # 300 > 256 tokens of capacity
    result = simulate(SimConfig(setup=policy_setup("shoal"), profile=TINY, num_instances=2), workload)
    assert result.rejected == 1 and result.num_finished == 2
    assert result.rejected_share == pytest.approx(1 / 3)
    assert result.warnings == ["1 of 3 requests (33.33%) rejected: prompt beyond every instance's capacity; "
                               "they are in no latency metric"]
    clean = simulate(SimConfig(setup=policy_setup("shoal"), profile=TINY, num_instances=2),
                     _workload((0.0, 100, 5), (0.2, 50, 5)))
    assert clean.rejected == 0 and clean.warnings == []


def test_preemptions_are_counted_with_their_loss() -> None:
    # 6 requests of 40 prompt tokens each growing to 100 tokens on one 256-token instance.
    workload = _workload(*((0.0, 40, 60) for _ in range(6)))
    result = simulate(SimConfig(setup=policy_setup("infaas"), profile=TINY, num_instances=1), workload)
    assert result.num_finished == 6
    assert result.preemptions > 0 and result.preemption_loss_s > 0


def test_migration_moves_requests_off_an_overloaded_instance(overloaded_paper_run: PaperRun) -> None:
    # Round-robin-free setup: llumnix dispatch packs nothing, so build imbalance with time:
    # long requests land on both instances, then one finishes early and its peer migrates to it.
    workload, config, sim, result = (overloaded_paper_run.workload, overloaded_paper_run.config,
                                     overloaded_paper_run.sim, overloaded_paper_run.result)
    assert result.migrations > 0 and result.num_finished == len(workload.requests)
    moved = [r for r in sim.records.values() if r.num_migrations > 0]
    # every completed migration is counted on the request it moved, some requests more than once
    assert sum(r.num_migrations for r in moved) == result.migrations
    assert result.max_migrations_per_request == max(r.num_migrations for r in moved) > 1
    assert result.churn == sum(r.num_migrations > CHURN_THRESHOLD for r in moved) / len(workload.requests)
    assert result.migrations_started == result.migrations + result.migrations_aborted
    # downtime = the last stage's copy (<= a few 8 MiB blocks at 10 GB/s) + 5 ms commit
    assert 0.005 <= result.migration_downtime_mean_s < 0.02
    baseline = simulate(replace(config, setup=policy_setup("infaas")), workload)
    assert baseline.migrations == 0


def test_slower_migration_bandwidth_lengthens_downtime(overloaded_paper_run: PaperRun) -> None:
    fast = overloaded_paper_run.result  # 10 GB/s
    slow_model = MigrationModel(bandwidth_bytes_per_s=0.5e9)
    slow = simulate(replace(overloaded_paper_run.config, migration=slow_model), overloaded_paper_run.workload)
    assert fast.migrations > 0 and slow.migrations > 0
    assert slow.migration_downtime_mean_s > fast.migration_downtime_mean_s


def test_high_priority_requests_get_ahead_only_with_priorities() -> None:
    workload = with_priorities(synthetic_workload(200, 40.0, mix="M-M", seed=5), 0.2, seed=5)
    with_prio = simulate(SimConfig(setup=policy_setup("llumnix"), num_instances=1), workload)
    without = simulate(SimConfig(setup=policy_setup("llumnix-base"), num_instances=1), workload)
    assert with_prio.by_priority["high"].ttft_mean_s < without.by_priority["high"].ttft_mean_s
    assert with_prio.by_priority["high"].ttft_mean_s < with_prio.by_priority["normal"].ttft_mean_s


def test_autoscaling_sheds_idle_instances_and_pays_the_cold_start() -> None:
    scaling = ScalingConfig(min_freeness=10, max_freeness=60, sustain_s=2.0, min_instances=1, max_instances=4)
    setup = policy_setup("shoal", scaling=scaling)
    light = synthetic_workload(40, 0.5, mix="S-S", seed=2)
    result = simulate(SimConfig(setup=setup, num_instances=4, autoscale=True), light)
    assert result.num_finished == 40
    assert result.instances_mean < 2.5
    assert min(n for _, n in result.instances_series) == 1
    # a burst on one instance makes it scale up; the new instance joins after the start-up delay
    burst = synthetic_workload(100, 30.0, mix="L-L", seed=2)
    sim = Simulator(SimConfig(setup=setup, num_instances=1, autoscale=True, startup_delay_s=5.0), burst)
    grown = sim.run()
    assert max(n for _, n in grown.instances_series) > 1
    delays = [joined - launched for _, launched, joined in sim.joins if launched > 0]
    assert delays and all(delay == pytest.approx(5.0) for delay in delays)


def test_pairing_band_gates_migration(overloaded_paper_run: PaperRun) -> None:
    assert overloaded_paper_run.result.migrations > 0  # the paper's band (3, 30)
    never = policy_setup("llumnix", pairing=PairingConfig(low_freeness=-1e9, high_freeness=1e9))
    config = replace(overloaded_paper_run.config, setup=never)
    assert simulate(config, overloaded_paper_run.workload).migrations == 0


def test_fragmentation_counts_free_blocks_elsewhere_up_to_the_blocked_demand() -> None:
    # instance 0: 10 free, its head needs 30 (blocked); instance 1: 50 free, no head
    assert fragmentation_share([10, 50], [30, 0], 200) == pytest.approx(30 / 200)
    # a head that fits is not blocked
    assert fragmentation_share([10, 50], [5, 0], 200) == 0.0
    # two blocked heads cannot count more than every free block
    assert fragmentation_share([10, 10], [100, 100], 200) == pytest.approx(20 / 200)


def test_begin_and_end_step_give_what_step_gives() -> None:
    from agents.engines.sim import SimEngine
    from schemas import SamplingParams

    def drive(split: bool) -> list[tuple[str, int, float]]:
        engine = SimEngine("tiny-test")
        for k in range(5):
            engine.add_request(f"q{k}", [1] * (10 + 7 * k), SamplingParams(max_tokens=12, ignore_eos=True))
        seen: list[tuple[str, int, float]] = []
        while engine.has_unfinished():
            if split:
                plan, duration = engine.begin_step()
                result = engine.end_step(plan, duration)
            else:
                result = engine.step()
            seen += [(o.request_id, o.token_ids[0], result.duration_s) for o in result.outputs]
        return seen

    assert drive(split=True) == drive(split=False)


def test_a_long_context_profile_serves_prompts_the_a10_rejects() -> None:
    h100 = load_profile("llama-3.1-8b-h100")
    assert h100.kv_bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16  # config.json: 32 layers, 8 KV heads, bf16
    assert load_profile("llama-3.1-70b-tp4-h100").kv_bytes_per_block == 2 * 80 * 8 * 128 * 2 * 16
    workload = _workload((0.0, 20_000, 4), (0.5, 60_000, 4), (1.0, 500, 4))
    a10 = simulate(SimConfig(setup=policy_setup("shoal"), num_instances=2), workload)
    assert a10.rejected == 2 and a10.num_finished == 1
    served = simulate(SimConfig(setup=policy_setup("shoal"), profile=h100, num_instances=2), workload)
    assert served.rejected == 0 and served.num_finished == 3
    # a 60k-token prefill takes seconds even on an H100 (~28k tokens/s here, quadratic attention)
    assert 2.0 < served.ttft_p99_s < 10.0


def test_a_per_step_token_budget_interleaves_a_long_prefill_with_decodes() -> None:
    # One H100: a request decoding 200 tokens, then a 60k-token prompt arrives. Prefilled in one
    # step, the prompt stalls the decode for ~4 s; with a budget of 2,048 tokens per step it is
    # computed in ~30 chunks, each step also decoding (vLLM V1's chunked prefill). The work is
    # the same (each chunk attends to the prefix before it), so the decoder finishes at about the
    # same time, and the long prompt's first token comes later by the decode steps in between.
    h100 = load_profile("llama-3.1-8b-h100")
    workload = _workload((0.0, 100, 200), (0.5, 60_000, 4))

    def run(budget: int | None) -> tuple[float, float]:
        config = SimConfig(setup=policy_setup("shoal"), profile=h100, num_instances=1, max_step_tokens=budget)
        sim = Simulator(config, workload)
        result = sim.run()
        assert result.num_finished == 2 and result.parameters["max_step_tokens"] == budget
        decoder, long = sim.records["r0"], sim.records["r1"]
        return decoder.finish_s, long.first_token_s - long.arrival_s

    whole_finish_s, whole_ttft_s = run(None)
    chunked_finish_s, chunked_ttft_s = run(2048)
    assert 3.0 < whole_ttft_s < 5.0
    assert chunked_finish_s == pytest.approx(whole_finish_s, rel=0.05)
    # ~30 steps each with a decode (~6 ms) and a step's overhead, and no cheaper attention
    assert whole_ttft_s + 0.1 < chunked_ttft_s < whole_ttft_s + 1.0
    with pytest.raises(ValueError, match="max_step_tokens"):
        SimConfig(max_step_tokens=0)


def test_moving_queued_requests_off_a_stalled_queue_cuts_the_tail() -> None:
    # L-L overloads 3 A10s: long prompts queue behind each other while another instance frees
    # up. shoal's default moves a stalled queue's newest request (no KV) to an instance where it
    # starts at once, each at most once, after 0.5 s; requeue_after_s=0 turns it off; no other
    # policy does it.
    workload = synthetic_workload(150, 6.0, mix="L-L", seed=0)
    on = simulate(SimConfig(setup=policy_setup("shoal"), num_instances=3), workload)
    off = simulate(SimConfig(setup=policy_setup("shoal"), num_instances=3, requeue_after_s=0.0), workload)
    assert off.requeues == 0 and on.requeues > 10
    assert on.num_finished == off.num_finished == 150
    assert on.ttft_p99_s * 2 < off.ttft_p99_s and on.ttft_mean_s < off.ttft_mean_s
    assert on.parameters["requeue_after_s"] == SHOAL_REQUEUE_AFTER_S == 0.5
    assert off.parameters["requeue_after_s"] is None
    infaas = SimConfig(setup=policy_setup("infaas"), num_instances=4)
    assert infaas.requeue_s is None and SimConfig(setup=policy_setup("llumnix")).requeue_s is None
    assert SimConfig(setup=policy_setup("shoal", dispatch=DispatchPolicy.FREENESS)).requeue_s is None
    with pytest.raises(ValueError, match="requeue_after_s"):
        SimConfig(requeue_after_s=-1.0)
