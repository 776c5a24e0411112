"""The policy layer: the live fold and policies, fed load views, giving replayable decisions."""

from __future__ import annotations

import pytest

from scheduler.cluster_state import live_loads
from scheduler.config import ScalingConfig
from scheduler.policy import PendingRequest, make_dispatcher
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.policy_layer import (
    DispatchCall,
    FoldInputs,
    PairCall,
    PolicyLayer,
    ScaleCall,
    replay_policy_log,
)
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import synthetic_workload, with_priorities
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, Unpaired
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad


def _joined(instance_id: str) -> InstanceJoined:
    return InstanceJoined(
        instance_id=instance_id, num_blocks=100, block_size=16,
        model=ModelIdentity(model_id="m"),
        kv_layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16"),
        transport_address="sim://x", engine="sim", max_model_len=1600,
    )


def _report(instance_id: str, seq: int, used: int, running: int, accepted: int) -> LoadReport:
    return LoadReport(
        instance_id=instance_id, seq=seq, num_total_blocks=100, num_free_blocks=100 - used,
        num_reserved_blocks=0, running=(PriorityLoad(priority=0, num_running=running, num_blocks=used),),
        head_of_line_demand=0, num_waiting=0, batch_size=running, freeness=0.0, virtual_usage=float(used),
        num_accepted=accepted,
    )


def test_a_simulated_runs_recorded_inputs_replay_to_identical_decisions() -> None:
    scaling = ScalingConfig(sustain_s=2.0, min_instances=2, max_instances=6)
    workload = with_priorities(synthetic_workload(100, 9.0, mix="L-L", seed=11), 0.1, seed=11)
    config = SimConfig(
        setup=policy_setup("shoal", scaling=scaling), num_instances=4, autoscale=True,
        startup_delay_s=3.0, record_policy_log=True,
    )
    sim = Simulator(config, workload)
    sim.run()
    assert sim.log is not None
    recorded = sim.log.decisions()
    kinds = {type(d) for d in recorded if d is not None}
    # the run exercised every kind of decision, on inputs that were load reports
    assert {Dispatched, Paired, Unpaired, ScaleUp, ScaleDown} <= kinds
    reports = [b for e in sim.log.entries if isinstance(e, FoldInputs) for b in e.bodies
               if isinstance(b, LoadReport)]
    assert len(reports) > 100
    replayed = replay_policy_log(sim.log.entries, config.setup.policy)
    assert replayed.decisions() == recorded


def test_replay_with_a_different_policy_decides_differently() -> None:
    workload = synthetic_workload(60, 9.0, mix="L-L", seed=11)
    config = SimConfig(setup=policy_setup("shoal"), num_instances=4, record_policy_log=True)
    sim = Simulator(config, workload)
    sim.run()
    assert sim.log is not None
    other = replay_policy_log(sim.log.entries, policy_setup("rr").policy)
    assert other.decisions() != sim.log.decisions()


def test_layer_dispatch_is_make_dispatcher_over_the_folded_views() -> None:
    layer = PolicyLayer(policy_setup("shoal").policy)
    layer.fold([_joined("b"), _joined("a"), _joined("c")])
    layer.fold([_report("a", 1, 40, 2, 2), _report("b", 1, 10, 1, 1), _report("c", 1, 10, 1, 1)])
    request = PendingRequest(request_id="q", num_prompt_tokens=160, arrival=1.0)
    expected = make_dispatcher("prefill_ahead", layer.config).choose(
        request, live_loads(layer.state), num_dispatched=0,
    )
    decision = layer.dispatch(request)
    assert decision == expected
    assert decision is not None and decision.instance_id == "b"  # b and c tie: the smaller id wins
    # the dispatch now counts against b until a report reflects it, so the next one goes to c
    second = layer.dispatch(PendingRequest(request_id="q2", num_prompt_tokens=160, arrival=1.1))
    assert second is not None and second.instance_id == "c"


def test_prompts_no_instance_can_hold_are_rejectable_only_once_instances_are_live() -> None:
    layer = PolicyLayer(policy_setup("infaas").policy)
    assert layer.can_ever_place(10) is None
    layer.fold([_joined("a")])
    assert layer.can_ever_place(1600) is True
    assert layer.can_ever_place(1601) is False
    assert layer.dispatch(PendingRequest(request_id="big", num_prompt_tokens=5000)) is None


def test_log_entries_keep_the_order_of_calls() -> None:
    layer = PolicyLayer(policy_setup("llumnix").policy)
    from scheduler.sim.policy_layer import PolicyLog

    layer.log = PolicyLog()
    layer.fold([_joined("a")])
    layer.dispatch(PendingRequest(request_id="q", num_prompt_tokens=16))
    layer.pair()
    layer.scale(1.0)
    assert [type(e) for e in layer.log.entries] == [FoldInputs, DispatchCall, PairCall, ScaleCall]


def test_a_run_that_moves_queued_requests_replays_to_identical_decisions() -> None:
    # L-L overloads 3 instances: queues stall and queued requests move (each logged as a dispatch
    # of the request with its stalled instance excluded); the replay recomputes every decision.
    workload = synthetic_workload(150, 6.0, mix="L-L", seed=0)
    config = SimConfig(
        setup=policy_setup("shoal"), num_instances=3, record_policy_log=True, requeue_after_s=1.0
    )
    sim = Simulator(config, workload)
    result = sim.run()
    assert result.requeues > 0 and result.num_finished == 150
    assert sim.log is not None
    moves = [e for e in sim.log.entries if isinstance(e, DispatchCall) and e.request.exclude]
    assert len(moves) == result.requeues
    assert replay_policy_log(sim.log.entries, config.setup.policy).decisions() == sim.log.decisions()


@pytest.mark.parametrize(
    ("mix", "rate", "policy", "field"),
    [
        # S-L (short prompts, long outputs): each instance learns the output length from the requests
        # it finishes and reports the growth it expects; dispatch and the moves take it off the room
        ("S-L", 4.0, "blocks_ahead_growth", "expected_growth_blocks"),
        # L-S (long prompts, short outputs): reports made while a step prefills carry the blocks of its
        # prompts; dispatch and the moves of queued requests count them as work ahead
        ("L-S", 6.0, "prefill_ahead", "prefill_blocks"),
    ],
)
def test_a_run_under_a_report_driven_rule_reports_its_input_and_replays_to_identical_decisions(
    mix: str, rate: float, policy: str, field: str
) -> None:
    # 4 instances; the replay of the policy log recomputes every decision.
    from scheduler.config import DispatchPolicy

    workload = synthetic_workload(100, rate, mix=mix, seed=3)
    config = SimConfig(
        setup=policy_setup("shoal", dispatch=DispatchPolicy(policy)),
        num_instances=4,
        record_policy_log=True,
    )
    sim = Simulator(config, workload)
    result = sim.run()
    assert result.num_finished == 100
    assert sim.log is not None
    reported = [
        body
        for entry in sim.log.entries
        if isinstance(entry, FoldInputs)
        for body in entry.bodies
        if getattr(body, field, 0) > 0
    ]
    assert reported
    dispatched = [d for d in sim.log.decisions() if isinstance(d, Dispatched)]
    assert {d.policy for d in dispatched} == {policy}
    assert replay_policy_log(sim.log.entries, config.setup.policy).decisions() == sim.log.decisions()
