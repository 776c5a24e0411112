"""Live migration on the agents: the protocol's two state machines and the shells that run them.

* :mod:`agents.migration.fsm` — the pure protocol: phases, transition tables,
  ``step(state, input) -> (state, actions)``, one rollback per side, and the
  :class:`~agents.migration.fsm.config.MigrationConfig` they read. The agents'
  shells below and the simulator (:mod:`scheduler.sim.migration_shell`) both
  drive these same machines; nothing else implements the protocol.
* :mod:`agents.migration.fsm.record` — what a shell saw its machine do (start,
  inputs, transitions, actions), kept by both shells and re-fed by
  :func:`~agents.migration.fsm.record.replay` to prove it.
* :mod:`agents.migration.host` — the narrow protocols the shells depend on
  (what they use of the agent, and what a driver uses of its manager).
* :mod:`agents.migration.manager` — one agent's migrations: routing, faults,
  ticks, the scheduler's ``MigrateOut`` command.
* :mod:`agents.migration.driver`, :mod:`~agents.migration.source`,
  :mod:`~agents.migration.destination` — executing one machine's actions
  against the engine, the transport and the bus.
* :mod:`agents.migration.log` — the outcome claim (first claim in the log wins)
  and the handshake's record; :mod:`agents.migration.directory` — the peers.
"""
