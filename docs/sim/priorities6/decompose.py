"""Round 6 (docs/SIMULATION.md): what each request's TTFT is made of, for the slowest of each class.

    python docs/sim/priorities6/decompose.py RATE SEED [FLAGS]   # M-M, 3,000 requests, 10% high, shoal
    python docs/sim/priorities6/decompose.py 11 1 prompts_by_priority

FLAGS: comma-separated SimConfig booleans (priority_preemption, prompts_by_priority). Per request:
the wait for the step in flight on its instance when it arrived, the rest of the wait until the
step that prefills it (queue, memory), its own prefill alone (the profile's ``prefill_ms``) and
the rest of that step (other prompts, decodes). Chunked prefill is not handled.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from agents.engines.profile import TimingModel
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.event_kinds import EventKind
from scheduler.sim.instance import SimInstance
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import build_workload


class Traced(Simulator):
    """The simulator, noting when each instance's step ends and when each prompt is prefilled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timing = TimingModel(self.config.profile)
        self.step_end: dict[str, float] = {}
        self.trace: dict[str, dict[str, float]] = {}

    def push(self, at: float, kind: int, payload: Any = None) -> None:
        if kind == EventKind.STEP_END:
            self.step_end[payload.instance_id] = at
        super().push(at, kind, payload)

    def kick(self, instance: SimInstance) -> None:
        before = instance.plan
        super().kick(instance)
        plan = instance.plan
        if plan is None or plan is before:
            return
        for prefill in plan.prefills:
            note = self.trace.setdefault(prefill.request.request_id, {})
            if prefill.start == 0 and "admitted" not in note:
                note["admitted"] = self.now
                note["own"] = self.timing.prefill_ms(prefill.num_tokens) / 1000
                note["rest"] = instance.plan_duration_s - note["own"]
                note["tokens"] = prefill.num_tokens

    def _on_arrival(self, index: int) -> None:
        request = self.workload.requests[index]
        super()._on_arrival(index)
        for instance in self.instances.values():
            if request.request_id in instance.request_ids:
                in_flight = instance.plan is not None and all(
                    p.request.request_id != request.request_id for p in instance.plan.prefills
                )
                end = self.step_end.get(instance.instance_id, self.now)
                note = self.trace.setdefault(request.request_id, {})
                note["in_flight"] = max(end - self.now, 0.0) if in_flight else 0.0


def main(rate: float, seed: int, flags: list[str]) -> None:
    config = SimConfig(setup=policy_setup("shoal"), **dict.fromkeys(flags, True))
    workload = build_workload("M-M", num_requests=3000, rate=rate, seed=seed, high_share=0.1)
    sim = Traced(config, workload)
    sim.run()
    rows = []
    for request_id, record in sim.records.items():
        note = sim.trace.get(request_id, {})
        if "admitted" not in note:
            continue  # migrated or preempted before its first token: not decomposed
        ttft = record.first_token_s - record.arrival_s
        in_flight = note.get("in_flight", 0.0)
        queued = note["admitted"] - record.arrival_s - in_flight
        rows.append((record.priority, ttft, in_flight, queued, note["own"], note["rest"], note["tokens"]))
    table = np.array(rows)
    for priority, name in ((-1, "high"), (0, "normal")):
        mine = table[table[:, 0] == priority]
        ttft = mine[:, 1]
        means = ", ".join(f"{label} {value:.3f}" for label, value in zip(
            ("in flight", "queued", "own prefill", "rest of its step"), mine[:, 2:6].mean(0), strict=True))
        print(f"{name}: {len(mine)} requests, TTFT mean {ttft.mean():.3f} s, "
              f"P99 {np.percentile(ttft, 99):.3f} s; means: {means}")
        print("  slowest 1%: TTFT, in flight, queued, own prefill, rest of step (s), prompt tokens")
        for row in mine[np.argsort(-ttft)][: max(3, len(mine) // 100 + 1)]:
            print("   ", " ".join(f"{x:.3f}" for x in row[1:6]), int(row[6]))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 11.0, int(args[1]) if len(args) > 1 else 0,
         args[2].split(",") if len(args) > 2 else [])
