"""Round 6 (docs/SIMULATION.md): the P99 of each class's own prefill time, no waiting at all.

    python docs/sim/priorities6/floor.py            # M-M at 11 req/s, 10% high, seeds 0-2, A10 profile

A request's TTFT is at least its prompt's prefill alone (the profile's ``prefill_ms``); the P99
of that over a class is the class's TTFT floor, whatever the scheduling.
"""

from __future__ import annotations

import sys

import numpy as np

from agents.engines.profile import TimingModel, load_profile
from scheduler.sim.workload import build_workload


def main(mix: str = "M-M", rate: float = 11.0, cv: float = 1.0) -> None:
    timing = TimingModel(load_profile("llama-7b-a10"))
    for seed in (0, 1, 2):
        workload = build_workload(mix, num_requests=3000, rate=rate, seed=seed, high_share=0.1, cv=cv)
        p99 = {}
        for priority, name in ((-1, "high"), (0, "normal")):
            prefill = [timing.prefill_ms(r.num_prompt_tokens) / 1000 for r in workload.requests
                       if r.priority == priority]
            p99[name] = float(np.percentile(prefill, 99))
        print(f"{mix} seed {seed}: own-prefill P99 high {p99['high']:.3f} s, normal {p99['normal']:.3f} s, "
              f"normal/high {p99['normal'] / p99['high']:.2f}x")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "M-M", float(args[1]) if len(args) > 1 else 11.0,
         float(args[2]) if len(args) > 2 else 1.0)
