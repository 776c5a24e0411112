"""A simulated run several tests read: the paper's policy on an overloaded cluster.

``llumnix`` on two A10 instances that long prompts and long outputs (``L-L``) overload:
requests migrate, one of them many times, and many migrations abort because the
destination ran out of blocks while they copied. ``tests/scheduler/sim/conftest.py``
makes it once per test session (the ``overloaded_paper_run`` fixture); the tests only
read it, and each compares it with runs of its own on the same workload and config.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.metrics import SimResult
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import Workload, synthetic_workload

__all__ = ["OVERLOADED", "PaperRun", "overloaded_paper_run"]

#: 120 L-L requests at 6 req/s on two A10s: the queues grow for the whole run
OVERLOADED = synthetic_workload(120, 6.0, mix="L-L", seed=3)


@dataclass(frozen=True)
class PaperRun:
    """A finished run: its workload, its config, the simulator (records, migrations) and its result."""

    workload: Workload
    config: SimConfig
    sim: Simulator
    result: SimResult


def overloaded_paper_run() -> PaperRun:
    """The run, made now (every finished migration recorded with its machines' records)."""
    config = SimConfig(setup=policy_setup("llumnix"), num_instances=2, record_migrations=True)
    sim = Simulator(config, OVERLOADED)
    result = sim.run()
    return PaperRun(workload=OVERLOADED, config=config, sim=sim, result=result)
