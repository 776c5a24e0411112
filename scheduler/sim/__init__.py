"""The discrete-event cluster simulator behind ``shoal simulate`` (see docs/simulation.md).

N ``sim`` engines on a virtual clock, driven by the live scheduler's fold and
policies (:class:`PolicyLayer`), with staged live migration, preemption and
auto-scaling. Modules: :mod:`~scheduler.sim.config` (what to simulate),
:mod:`~scheduler.sim.workload` (traces and synthetic workloads),
:mod:`~scheduler.sim.sessions` (multi-turn chat sessions),
:mod:`~scheduler.sim.prompts` (prompt token ids, shared where prompts share),
:mod:`~scheduler.sim.policy_layer` (the global scheduler),
:mod:`~scheduler.sim.instance` (an engine and its agent),
:mod:`~scheduler.sim.migration` (which requests migrate, and the counts),
:mod:`~scheduler.sim.migration_shell` (one migration: the agents' own state
machines of :mod:`agents.migration.fsm` on the virtual clock),
:mod:`~scheduler.sim.migration_ports` (what migration needs of the rest),
:mod:`~scheduler.sim.simulator` (the event loop), :mod:`~scheduler.sim.metrics`,
:mod:`~scheduler.sim.sweep`, :mod:`~scheduler.sim.plots` (matplotlib, imported
on use) and :mod:`~scheduler.sim.cli`.
"""

from scheduler.sim.config import MigrationModel, PolicyName, PolicySetup, SimConfig, policy_setup
from scheduler.sim.metrics import SimResult
from scheduler.sim.policy_layer import PolicyLayer, PolicyLog, replay_policy_log
from scheduler.sim.simulator import SimulationIncomplete, Simulator, simulate
from scheduler.sim.workload import (
    SimRequest,
    Workload,
    build_workload,
    load_trace,
    synthetic_workload,
    with_priorities,
)

__all__ = [
    "MigrationModel",
    "PolicyLayer",
    "PolicyLog",
    "PolicyName",
    "PolicySetup",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "SimulationIncomplete",
    "Simulator",
    "Workload",
    "build_workload",
    "load_trace",
    "policy_setup",
    "replay_policy_log",
    "simulate",
    "synthetic_workload",
    "with_priorities",
]
