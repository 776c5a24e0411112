"""``shoal drill``: fault-injection drills a user runs against a cluster, with verified faults and a report.

* :mod:`~frontend.drill.scenario` — the scenario models, built-in scenarios, TOML files;
* :mod:`~frontend.drill.cluster` — the cluster a drill starts (shared with ``shoal up``);
* :mod:`~frontend.drill.proxy` — the TCP chaos proxy in front of NATS and the KV transport;
* :mod:`~frontend.drill.load` — the OpenAI load and each request's outcome;
* :mod:`~frontend.drill.watch` — what the drill follows on the bus, and the agents' ``stats`` RPC;
* :mod:`~frontend.drill.faults` — injecting a fault and verifying that it took effect;
* :mod:`~frontend.drill.verdicts` — the computed verdicts;
* :mod:`~frontend.drill.runner` — one scenario start to end;
* :mod:`~frontend.drill.report` — terminal table, JSON, PNG;
* :mod:`~frontend.drill.cli` — the ``shoal drill`` command.

See ``frontend/drill/README.md`` for the scenarios and measured results.
"""
