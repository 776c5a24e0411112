"""The public face of ``shoal agent``: the :class:`Agent` and its configuration.

Others import from here: ``Agent(engine, bus, AgentConfig(instance_id=...))``,
``await agent.start()``, ``await agent.migrate(request_id, destination_id)``,
``await agent.stop()``. The pieces live in :mod:`agents.service` (the loop and
RPCs), :mod:`agents.migration` (both migration sides), :mod:`agents.reporting`
(load reports), :mod:`agents.deltas` (token buffers), :mod:`agents.tracing`.
"""

from agents.config import AgentConfig, FaultPlan, StepPace
from agents.migration.source import MigrationOutcome, StageRecord
from agents.service import Agent

__all__ = ["Agent", "AgentConfig", "FaultPlan", "MigrationOutcome", "StageRecord", "StepPace"]
