"""The simulated scheduler's prefix index: dispatches see each instance's cached leading blocks as
the live scheduler does, and a migration copies only the blocks its destination does not cache."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.engines.profile import load_profile
from agents.migration.fsm.config import MigrationConfig
from scheduler.config import PairingConfig, PolicyConfig
from scheduler.sim.config import MigrationModel, SimConfig, policy_setup
from scheduler.sim.instance import SimInstance
from scheduler.sim.policy_layer import DispatchCall
from scheduler.sim.sessions import SessionSpec, session_workload, system_prompt_workload
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import SimRequest, Workload
from schemas.load import LoadReport

TINY = load_profile("tiny-test")  # 64 blocks of 4 tokens, 1 KiB each
A10 = load_profile("llama-7b-a10")  # 16-token blocks


def test_every_dispatch_carries_what_each_instance_caches_of_its_prompt_and_the_engine_finds_it() -> None:
    # two system prompts, slow sessions: the index is current at every dispatch (batches every 100 ms)
    spec = SessionSpec(num_sessions=12, rate=0.5, turns=3, groups=2, system_tokens=512, think_s=5.0, seed=3)
    workload = session_workload(spec)
    config = SimConfig(
        setup=policy_setup("rr"), profile=A10, num_instances=2, prefix_cache=True, record_policy_log=True
    )
    sim = Simulator(config, workload)
    result = sim.run()
    assert sim.log is not None
    calls = [e for e in sim.log.entries if isinstance(e, DispatchCall) and e.decision is not None]
    assert len(calls) == result.num_requests == len(workload.requests)
    with_hits = [c for c in calls if c.request.cached_tokens]
    assert len(with_hits) > len(calls) // 2  # later turns and repeated system prompts
    for call in calls:
        assert call.decision is not None
        chosen = call.decision.instance_id
        said = dict(call.request.cached_tokens).get(chosen, 0)
        record = sim.records[call.request.request_id]
        # the engine never recomputes a prompt's last token, so it finds at most all but its last block
        usable = (record.num_prompt_tokens - 1) // A10.block_size * A10.block_size
        assert record.num_cached_tokens == min(said, usable), call.request.request_id
        assert all(tokens % A10.block_size == 0 for _, tokens in call.request.cached_tokens)
    assert result.cached_tokens > 0


def test_without_the_prefix_cache_no_dispatch_carries_cached_tokens() -> None:
    spec = SessionSpec(num_sessions=4, rate=0.5, turns=2, groups=1, system_tokens=256, think_s=1.0)
    config = SimConfig(setup=policy_setup("rr"), profile=A10, num_instances=2, record_policy_log=True)
    sim = Simulator(config, session_workload(spec))
    sim.run()
    assert sim.log is not None
    assert not any(e.request.cached_tokens for e in sim.log.entries if isinstance(e, DispatchCall))


def test_a_request_migrating_back_copies_only_the_blocks_its_old_instance_no_longer_caches() -> None:
    # one long request paired back and forth between two tiny instances: when it comes back, the
    # instance it left still caches its first blocks (freed, kept by the prefix cache)
    setup = policy_setup("llumnix-base", pairing=PairingConfig(low_freeness=60, high_freeness=63))
    config = SimConfig(
        setup=setup,
        profile=TINY,
        num_instances=2,
        record_migrations=True,
        migration=MigrationModel(config=MigrationConfig(max_stages=2)),
    )
    request = SimRequest(request_id="long", arrival_s=0.0, num_prompt_tokens=40, num_output_tokens=150)
    workload = Workload(requests=(request,), description="one long request")
    cached = Simulator(replace(config, prefix_cache=True), workload)
    plain = Simulator(config, workload)
    with_cache, without = cached.run(), plain.run()
    committed = [m for m in cached.migrations.finished if m.migrated]
    assert len(committed) >= 2
    assert committed[0].num_cached_blocks == 0  # the first destination never saw the request
    back = [m for m in committed[1:] if m.num_cached_blocks]
    assert back, [m.num_cached_blocks for m in committed]
    assert with_cache.migration_bytes_saved == sum(m.num_cached_blocks for m in committed) * 1024
    assert 0 < with_cache.migration_saved_share < 1
    # held blocks are not copied: a migration copies less than in the same run without the cache
    per_migration = with_cache.migration_bytes_per_migration
    assert per_migration < without.migration_bytes_per_migration
    assert cached.records["long"].num_output_tokens == 150 and with_cache.num_finished == 1
    assert without.migration_bytes_saved == 0 and without.migration_saved_share == 0


def test_the_cache_aware_policies_find_more_of_the_shared_system_prompts_than_round_robin() -> None:
    kv, prefix, cost = (policy_setup(name) for name in ("kv", "prefix", "shoal-cost"))
    assert not kv.migrate and not prefix.migrate and not kv.priorities and kv.requeue_after_s is None
    assert cost.migrate and cost.priorities and cost.requeue_after_s is not None
    workload = system_prompt_workload(120, 4.0, groups=12, system_tokens=1024, answer_tokens=16, seed=2)
    base = SimConfig(profile=A10, num_instances=4, prefix_cache=True)
    hit_rates = {
        name: Simulator(replace(base, setup=policy_setup(name)), workload).run().prefix_cache_hit_rate
        for name in ("rr", "kv", "prefix", "shoal-cost")
    }
    for name in ("kv", "prefix", "shoal-cost"):
        assert hit_rates[name] > hit_rates["rr"] + 0.05, hit_rates


def test_a_load_report_counts_the_queue_without_the_blocks_the_cache_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one tiny instance (64 blocks): one request at a time fits; three more with its prompt wait
    config = SimConfig(setup=policy_setup("rr"), profile=TINY, num_instances=1, prefix_cache=True)
    prompt = ((7, 40),)
    requests = tuple(
        SimRequest(
            request_id=f"r{k}",
            arrival_s=0.01 * k,
            num_prompt_tokens=40,
            num_output_tokens=200,
            segments=prompt,
        )
        for k in range(4)
    )
    sim = Simulator(config, Workload(requests=requests, description="one prompt four times"))
    reports = []
    original = SimInstance.build_report

    def spy(instance: SimInstance, policy: PolicyConfig) -> LoadReport:
        report = original(instance, policy)
        reports.append(report)
        return report

    monkeypatch.setattr(SimInstance, "build_report", spy)
    sim.run()
    queued = [r for r in reports if r.num_waiting]
    assert queued
    assert all(0 <= r.waiting_uncached_blocks < r.waiting_demand for r in queued)


def test_a_run_reports_how_unevenly_requests_ran_and_the_hot_prompts_p99_ttft() -> None:
    workload = system_prompt_workload(
        200, 8.0, groups=10, system_tokens=512, answer_tokens=64, hot_group_share=0.5, seed=4
    )
    base = SimConfig(profile=A10, num_instances=4, prefix_cache=True)
    spread = Simulator(replace(base, setup=policy_setup("rr")), workload).run()
    assert 1.0 <= spread.running_max_over_mean < 1.5  # round-robin spreads evenly
    assert 0 < spread.hot_prefix_ttft_p99_s <= spread.ttft_p99_s * 1.5
    even = system_prompt_workload(200, 8.0, groups=10, system_tokens=512, answer_tokens=64, seed=4)
    assert Simulator(replace(base, setup=policy_setup("rr")), even).run().hot_prefix_ttft_p99_s == 0
