"""Where the slowest 1% of one simulated run spent their TTFT (round 6's diagnosis, docs/SIMULATION.md).

python docs/sim/policy5/tail.py POLICY RATE SEED [DISPATCH|-] [PROFILE] [WORKLOAD]
e.g. python docs/sim/policy5/tail.py shoal 20 2 blocks_ahead   (H100 azure-code by default)

Per request of the slowest 1%: arrival, prompt, the time left of the step in flight on its instance
when it arrived (and that step's prompt tokens), the prompt tokens queued there, the wait past that
step, its own step's duration, its own prompt's prefill and its step's prompt tokens and prompts.
A diagnosis aid, not part of the simulator: it wraps the simulator's private methods.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from agents.engines.profile import load_profile
from scheduler.config import DispatchPolicy
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.simulator import STEP_END, Simulator
from scheduler.sim.workload import build_workload


def main(argv: list[str]) -> None:
    policy, rate, seed = argv[0], float(argv[1]), int(argv[2])
    dispatch = argv[3] if len(argv) > 3 and argv[3] != "-" else None
    profile = argv[4] if len(argv) > 4 else "llama-3.1-8b-h100"
    workload = argv[5] if len(argv) > 5 else "azure-code"
    num = 2900 if workload == "azure-code" else 3000
    setup = policy_setup(policy, dispatch=None if dispatch is None else DispatchPolicy(dispatch))
    instances = 4 if "h100" in profile else 16
    config = SimConfig(setup=setup, profile=load_profile(profile), num_instances=instances)
    requests = build_workload(workload, num_requests=num, rate=rate, seed=seed, start=seed * num)
    sim = Simulator(config, requests)
    info: dict[str, dict[str, Any]] = {}
    ends: dict[str, float] = {}
    kick, place, push = sim.kick, sim._place, sim.push

    def traced_kick(instance: Any) -> None:
        idle = instance.plan is None
        kick(instance)
        if idle and instance.plan is not None:
            total = sum(c.num_tokens for c in instance.plan.prefills)
            for chunk in instance.plan.prefills:
                entry = info.setdefault(chunk.request.request_id, {})
                own_s = instance.engine.timing.prefill_ms(chunk.num_tokens) / 1000
                step = (sim.now, instance.plan_duration_s, total, len(instance.plan.prefills), own_s)
                entry.setdefault("step", step)

    def traced_place(pending: Any, request: Any) -> None:
        states = {}
        for iid, inst in sim.instances.items():
            left = ends.get(iid, sim.now) - sim.now if inst.plan is not None else 0.0
            in_flight = sum(c.num_tokens for c in inst.plan.prefills) if inst.plan is not None else 0
            queued = sum(len(r.all_token_ids) for r in inst.engine.scheduler.waiting_requests())
            states[iid] = (max(left, 0.0), in_flight, queued)
        place(pending, request)
        chosen = next((i for i, ins in sim.instances.items() if pending.request_id in ins.request_ids), None)
        info.setdefault(pending.request_id, {}).update(
            arrival=sim.now, prompt=pending.num_prompt_tokens, state=states.get(chosen, (0.0, 0, 0))
        )

    def traced_push(at: float, kind: int, payload: Any = None) -> None:
        if kind == STEP_END:
            ends[payload.instance_id] = at
        push(at, kind, payload)

    sim.kick, sim._place, sim.push = traced_kick, traced_place, traced_push  # type: ignore[method-assign]
    result = sim.run()
    print(f"{policy} {dispatch or ''} {rate:g} req/s seed {seed}: P99 TTFT {result.ttft_p99_s:.2f} s, "
          f"mean {result.ttft_mean_s:.3f} s")
    records = sim.records.items()
    ttfts = sorted((r.first_token_s - r.arrival_s, rid) for rid, r in records if r.first_token_s >= 0)
    rows = []
    for ttft, rid in ttfts[-max(1, len(ttfts) // 100):]:
        entry = info[rid]
        left, in_flight, queued = entry["state"]
        start, duration, step_tokens, step_prompts, own = entry["step"]
        rows.append((ttft, entry["arrival"], entry["prompt"], left, in_flight, queued,
                     start - entry["arrival"] - left, duration, own, step_tokens, step_prompts))
    print("TTFT @arrival prompt | step in flight: s left (tokens) | queued tokens | wait past it | "
          "own step s, own prefill s, its tokens, its prompts")
    for t, at, prompt, left, flight, queued, past, dur, own, tokens, prompts in rows:
        print(f"{t:.2f} @{at:.1f} {prompt:6d} | {left:.2f} ({flight:6d}) | {queued:6d} | {past:.2f} "
              f"| {dur:.2f} {own:.2f} {tokens:6d} {prompts}")
    m = [statistics.mean(r[i] for r in rows) for i in range(len(rows[0]))]
    print(f"mean: TTFT {m[0]:.2f}, in flight {m[3]:.2f} s ({m[4]:.0f} tokens), queued {m[5]:.0f} tokens, "
          f"past it {m[6]:.2f} s, own step {m[7]:.2f} s (own prefill {m[8]:.2f} s, {m[9]:.0f} tokens, "
          f"{m[10]:.1f} prompts)")


if __name__ == "__main__":
    main(sys.argv[1:])
