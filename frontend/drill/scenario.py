"""What a drill runs: the scenario models, the built-in scenarios and scenario files.

A :class:`Scenario` names a cluster (:class:`ClusterSpec`), a load
(:class:`LoadSpec`: rate, prompt and output lengths, streaming and greedy
shares), the three phases (steady load, fault, recovery) and the fault
(:class:`FaultSpec`). Built-in scenarios live in :data:`BUILTIN`; a user's
scenario is a TOML (or YAML) file with the same fields (:func:`load_scenario`), checked
by pydantic: a bad file is a :class:`ScenarioError` naming the field. Pure
data; nothing here starts a process.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "BUILTIN",
    "CI_SUITE",
    "FULL_SUITE",
    "ClusterSpec",
    "FaultKind",
    "FaultSpec",
    "LoadSpec",
    "Phases",
    "Scenario",
    "ScenarioError",
    "Target",
    "Verdicts",
    "load_scenario",
    "resolve",
]


class ScenarioError(ValueError):
    """A scenario file or name that cannot be run; the message names the field."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterSpec(_Model):
    """The cluster a drill starts (``--up``): engines, instances, and what the components run with."""

    engine: Literal["sim", "torch", "vllm"] = "sim"
    #: torch: a preset (``tiny``) or checkpoint folder; sim: a timing profile; vllm: a checkpoint
    #: folder (``shoal drill`` builds a small random one when none is given)
    model: str | None = None
    #: the agents' model dtype (torch, vllm); None: float32 for both on CPU, so greedy answers can be
    #: compared exactly (in bfloat16, what vLLM picks on CPU, a rescued request's recomputed prefix
    #: rounds differently from the token-by-token decode it replaces, and greedy tokens can change)
    dtype: str | None = None
    instances: Annotated[int, Field(ge=1, le=16)] = 3
    num_blocks: Annotated[int | None, Field(ge=4)] = None
    time_scale: Annotated[float, Field(gt=0)] = 10.0
    scheduler: bool = True
    #: a second scheduler started with ``--standby``: it follows the log (and the prefix-cache events)
    #: and takes over when the first one's lease expires
    standby_scheduler: bool = False
    #: seconds each migration stage's copy is delayed by (so a fault can land mid-stage)
    copy_delay_s: Annotated[float, Field(ge=0)] = 0.0
    #: every agent's engine step lasts at least this long (``shoal agent --fault-min-step``): a
    #: request of n tokens runs >= n times this however fast the engine, so a fault lands mid-request
    min_step_s: Annotated[float, Field(ge=0)] = 0.0
    #: seconds one stage's KV copy may take before the migration aborts
    copy_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    #: the scheduler's pairing band (None: its defaults)
    low_freeness: float | None = None
    high_freeness: float | None = None
    #: the scheduler marks an instance failed after this long without a load report
    failure_timeout_s: Annotated[float, Field(gt=0)] = 3.0
    stall_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    #: put the chaos proxy in front of NATS and of each agent's KV transport
    proxy_nats: bool = True
    proxy_kv: bool = True
    #: the agents' handshake fault plan: ``drop:out:Ack``, ``duplicate:in:Commit``, ... (``shoal agent
    #: --fault-drop/--fault-duplicate``), each applied at most ``handshake_fault_max`` times per agent
    handshake_faults: tuple[
        Annotated[str, Field(pattern=r"^(drop|duplicate):(in|out):"
                                     r"(PreAllocate|Ack|Abort|StageDone|Commit|CommitAck)$")], ...
    ] = ()
    handshake_fault_max: Annotated[int | None, Field(ge=1)] = 1
    #: restart an agent that exits unexpectedly, with backoff, and leave one that keeps crashing down
    #: (the supervision ``shoal up`` gives its children); False: a dead agent stays dead
    supervise: bool = False
    #: supervision: the first restart's delay (doubling with each exit within the window) and the
    #: exits within 60 s that leave a component down (``shoal up``: 1 s and 5)
    restart_delay_s: Annotated[float, Field(ge=0, le=30)] = 1.0
    max_restarts: Annotated[int, Field(ge=1, le=100)] = 5
    #: the frontend's bound: a request no instance can take fails with a 503 (or an error event, then
    #: ``[DONE]``) after this many seconds (``shoal serve --rescue-timeout``); None: its default
    rescue_timeout_s: Annotated[float | None, Field(gt=0)] = None
    #: agents (by index) whose engine fails at its first step: ``raise`` (the step raises) or ``exit``
    #: (the process dies there), ``shoal agent --fault-first-step``; such an agent is never ready
    first_step_faults: dict[Annotated[int, Field(ge=0)], Literal["raise", "exit"]] = Field(
        default_factory=dict
    )

    @model_validator(mode="after")
    def _faulty_agents_exist(self) -> ClusterSpec:
        beyond = sorted(i for i in self.first_step_faults if i >= self.instances)
        if beyond:
            raise ValueError(f"first_step_faults names agents {beyond}, but the cluster has "
                             f"{self.instances} (indices 0..{self.instances - 1})")
        if len(self.first_step_faults) >= self.instances:
            raise ValueError("first_step_faults: at least one agent must be able to step")
        return self

    @property
    def faulty_agent_ids(self) -> list[str]:
        """The instance ids of the agents whose engine fails at its first step."""
        return [f"agent-{i}" for i in sorted(self.first_step_faults)]

    def first_step_fault(self, instance_id: str) -> Literal["raise", "exit"] | None:
        """How agent ``instance_id``'s engine fails at its first step (None: it does not)."""
        return {f"agent-{i}": how for i, how in self.first_step_faults.items()}.get(instance_id)

    def on_engine(self, engine: Literal["sim", "torch", "vllm"]) -> ClusterSpec:
        """This cluster with agents of ``engine`` (``shoal drill --engine``), at the pace it had.

        A scenario written for the sim engine times its fault against requests that last what the
        sim's steps make them last (``time_scale`` x the profile's). A real engine on a small model
        steps much faster, so its requests would end before the fault lands (no busy agent to kill,
        no migration in flight): on a real engine each step lasts at least the sim's one-request
        decode step (``min_step_s``) unless the scenario set that itself.
        """
        if engine == self.engine:
            return self
        update: dict[str, object] = {"engine": engine, "model": None}
        if self.engine == "sim" and self.min_step_s == 0:
            from agents.engines.profile import TimingModel, load_profile

            decode_ms = TimingModel(load_profile(self.resolved_model)).decode_ms(1, 0)
            update["min_step_s"] = round(decode_ms * self.time_scale / 1000, 4)
        return self.model_copy(update=update)

    @property
    def resolved_model(self) -> str:
        if self.model is None and self.engine == "vllm":
            raise ScenarioError("cluster.model: a vllm drill needs a checkpoint folder")
        return self.model or ("tiny" if self.engine == "torch" else "tiny-test")


class LoadSpec(_Model):
    """An open-loop load: ``rate`` requests per second, sent through the OpenAI API."""

    rate: Annotated[float, Field(gt=0, le=1000)] = 4.0
    prompt_words: Annotated[int, Field(ge=1, le=4000)] = 8
    #: words every prompt starts with, the same for all (a shared system prompt: a prefix the agents'
    #: prefix caches hold once the first request computed it); 0: none
    prefix_words: Annotated[int, Field(ge=0, le=4000)] = 0
    output_tokens: Annotated[int, Field(ge=1, le=8192)] = 32
    stream_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    greedy_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    #: a request not ended this long after it was sent is lost
    request_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    seed: int = 0


class Phases(_Model):
    steady_s: Annotated[float, Field(ge=0)] = 4.0
    #: how long the fault phase lasts (a timed fault is undone at its end)
    fault_s: Annotated[float, Field(ge=0)] = 3.0
    recovery_s: Annotated[float, Field(ge=0)] = 6.0


class FaultKind(enum.StrEnum):
    NONE = "none"
    KILL = "kill"  # SIGKILL
    STOP = "stop"  # SIGSTOP for the fault phase, then SIGCONT
    TERM = "term"  # SIGTERM (an agent drains; others stop)
    RESTART = "restart"  # SIGTERM, then start again (nats-server: on the same file store)
    LATENCY = "latency"  # the chaos proxy delays every chunk
    BLACKHOLE = "blackhole"  # the chaos proxy forwards nothing (new connections hang)
    RESET = "reset"  # the chaos proxy resets every connection
    ROLLING_RESTART = "rolling_restart"  # SIGTERM each agent in turn, start a new one after it left
    MIGRATIONS = "migrations"  # start migrations (the cluster's handshake fault plan acts on them)
    #: kill -9 an agent, and again each time its supervisor brings it back, until it is left down
    CRASH_LOOP = "crash_loop"
    #: the agents of ``cluster.first_step_faults`` fail at their first step (set when they start)
    FIRST_STEP = "first_step"


class Target(enum.StrEnum):
    SCHEDULER = "scheduler"
    FRONTEND = "frontend"
    NATS = "nats"
    AGENT = "agent"  # the busiest agent
    AGENT_IDLE = "agent_idle"  # an agent running nothing
    MIGRATION_SOURCE = "migration_source"  # the source of a migration in flight
    MIGRATION_DESTINATION = "migration_destination"
    BUS = "bus"  # the chaos proxy in front of NATS
    KV = "kv"  # the chaos proxies in front of the agents' KV transports
    AGENT_BUS = "agent_bus"  # the busiest agent's own link to NATS (a partition of that agent)
    AGENTS = "agents"  # every agent at once

    @property
    def is_agent(self) -> bool:
        return self in (
            Target.AGENT,
            Target.AGENTS,
            Target.AGENT_IDLE,
            Target.MIGRATION_SOURCE,
            Target.MIGRATION_DESTINATION,
        )

    @property
    def needs_migration(self) -> bool:
        return self in (Target.MIGRATION_SOURCE, Target.MIGRATION_DESTINATION)


_PROCESS_FAULTS = {FaultKind.KILL, FaultKind.STOP, FaultKind.TERM, FaultKind.RESTART, FaultKind.CRASH_LOOP}
_PROXY_FAULTS = {FaultKind.LATENCY, FaultKind.BLACKHOLE, FaultKind.RESET}
_UNTARGETED = {FaultKind.NONE, FaultKind.ROLLING_RESTART, FaultKind.MIGRATIONS, FaultKind.FIRST_STEP}


class FaultSpec(_Model):
    kind: FaultKind = FaultKind.NONE
    target: Target | None = None
    #: latency: added delay per chunk, in milliseconds
    latency_ms: Annotated[float, Field(ge=0, le=60_000)] = 200.0
    #: restart a killed scheduler / frontend / nats-server this long after the kill (None: never)
    restart_after_s: Annotated[float | None, Field(ge=0)] = 1.0
    #: for migration targets and kv faults: wait for (or start) a migration first; its stage to hit
    during_migration: bool = False
    #: seconds to wait for the fault's precondition (an idle agent, a migration in flight)
    wait_s: Annotated[float, Field(gt=0)] = 15.0
    #: crash_loop: kill the agent at most this many times (its supervisor should give up first)
    max_kills: Annotated[int, Field(ge=1, le=50)] = 10

    @model_validator(mode="after")
    def _consistent(self) -> FaultSpec:
        if self.kind in _UNTARGETED:
            return self
        if self.target is None:
            raise ValueError(f"a {self.kind.value} fault needs a target")
        proxy_target = self.target in (Target.BUS, Target.KV, Target.AGENT_BUS)
        if self.kind in _PROXY_FAULTS and not proxy_target:
            raise ValueError(f"a {self.kind.value} fault targets 'bus' or 'kv', not {self.target.value!r}")
        if self.kind in _PROCESS_FAULTS and proxy_target:
            raise ValueError(f"a {self.kind.value} fault targets a process, not {self.target.value!r}")
        if self.target is Target.AGENTS and self.kind is not FaultKind.KILL:
            raise ValueError(f"every agent at once ('agents') is a kill target, not a {self.kind.value} one")
        if self.kind is FaultKind.CRASH_LOOP and self.target is not Target.AGENT:
            raise ValueError(f"a crash_loop fault targets 'agent' (the busiest), not {self.target.value!r}")
        return self


class Verdicts(_Model):
    """What a scenario must show to pass (beyond 0 lost, 0 leaked, a clean log)."""

    #: the fault must have caused at least one clean client-side error (frontend kill)
    expect_errors: bool = False
    #: client errors the drill tolerates (clean, retryable ones); None: any number
    max_errors: int | None = None
    #: the KV fault must have aborted a migration (the request continued on its source)
    expect_migration_abort: bool = False
    #: nothing recomputed: no rescue, no preemption (rolling restart with live migration)
    expect_no_recompute: bool = False
    #: at least one migration committed
    expect_migration_commit: bool = False
    #: the killed agent's requests were rescued (the frontend's rescue counter moved)
    expect_rescue: bool = False
    #: a request sent after the fault completes (False: nothing restarts what the fault took)
    expect_recovery: bool = True
    #: frontend kill: the agents hold none of its requests at most this long after it died
    max_orphan_s: float | None = None
    #: seconds past the frontend's bound a request may take to end with its error: the frontend first
    #: has to see its instance die (3 s without a load report) and the machine may be busy
    hang_margin_s: Annotated[float, Field(ge=0)] = 8.0
    #: an instance ready this long before a request ended with an error (or was lost), and still
    #: ready then, could have taken it (the frontend retries a rescue each second)
    ready_grace_s: Annotated[float, Field(ge=0)] = 3.0
    #: every killed agent came back by itself (supervision) and announced itself ready again
    expect_supervised_return: bool = False
    #: the crash-looping agent (crash_loop), each agent that cannot step (first_step) was left down
    #: by its supervisor
    expect_left_down: bool = False
    #: the scheduler's prefix index, as its dispatches recorded it, equals the prefix-cache events'
    #: fold, before the fault and after the takeover; and the prompt tokens served from the agents'
    #: prefix caches after the fault are a share no lower than before it, less ``hit_rate_margin``
    expect_prefix_index: bool = False
    hit_rate_margin: Annotated[float, Field(ge=0, le=1)] = 0.1


class Scenario(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    cluster: ClusterSpec = ClusterSpec()
    load: LoadSpec = LoadSpec()
    phases: Phases = Phases()
    fault: FaultSpec = FaultSpec()
    verdicts: Verdicts = Verdicts()

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        kind, cluster, expect = self.fault.kind, self.cluster, self.verdicts
        if kind is FaultKind.FIRST_STEP and not cluster.first_step_faults:
            raise ValueError("a first_step fault needs cluster.first_step_faults (which agents: raise, exit)")
        if cluster.first_step_faults and kind not in (FaultKind.FIRST_STEP, FaultKind.NONE):
            raise ValueError("cluster.first_step_faults goes with fault.kind first_step (or none)")
        if kind is FaultKind.CRASH_LOOP and not cluster.supervise:
            raise ValueError("a crash_loop fault needs cluster.supervise (nothing brings the agent back)")
        if expect.expect_supervised_return and not cluster.supervise:
            raise ValueError("verdicts.expect_supervised_return needs cluster.supervise")
        if expect.expect_left_down and kind not in (FaultKind.CRASH_LOOP, FaultKind.FIRST_STEP):
            raise ValueError("verdicts.expect_left_down goes with a crash_loop or first_step fault")
        if expect.expect_left_down and not cluster.supervise:
            raise ValueError("verdicts.expect_left_down needs cluster.supervise")
        if cluster.standby_scheduler and not cluster.scheduler:
            raise ValueError("cluster.standby_scheduler needs cluster.scheduler")
        if expect.expect_prefix_index and not cluster.scheduler:
            raise ValueError("verdicts.expect_prefix_index needs cluster.scheduler (its index is checked)")
        return self


def _scenario(name: str, description: str, fault: FaultSpec, **fields: object) -> Scenario:
    return Scenario.model_validate(
        {"name": name, "description": description, "fault": fault.model_dump(), **fields}
    )


_MIGRATING = {"copy_delay_s": 0.6}
_MIGRATION_FAULT = {"during_migration": True}

#: Built-in scenarios by name.
BUILTIN: dict[str, Scenario] = {
    s.name: s
    for s in [
        _scenario("baseline", "No fault: the reference run.", FaultSpec()),
        _scenario(
            "scheduler-kill",
            "kill -9 the scheduler; a new one recovers by replay after 1 s.",
            FaultSpec(kind=FaultKind.KILL, target=Target.SCHEDULER),
        ),
        _scenario(
            "scheduler-kill-cached",
            "kill -9 the scheduler while requests sharing a cached prompt prefix run on two torch `tiny` "
            "agents; its standby takes over: nothing lost, the standby's prefix index equals the fold of "
            "the agents' cache events (as every dispatch recorded it, before the kill and after), and the "
            "share of prompt tokens served from the cache holds.",
            FaultSpec(kind=FaultKind.KILL, target=Target.SCHEDULER, restart_after_s=None),
            # the standby takes over once the killed scheduler's lease expires; requests of 96 tokens at
            # steps of >= 5 ms last about 0.5 s, so some are always running when the kill lands
            cluster={"engine": "torch", "instances": 2, "min_step_s": 0.005, "standby_scheduler": True},
            load={"rate": 4.0, "prefix_words": 48, "prompt_words": 8, "output_tokens": 96},
            phases={"steady_s": 4.0, "fault_s": 5.0, "recovery_s": 5.0},
            verdicts={"expect_prefix_index": True},
        ),
        _scenario(
            "scheduler-stop",
            "SIGSTOP the scheduler for the fault phase (hung, not dead), then SIGCONT.",
            FaultSpec(kind=FaultKind.STOP, target=Target.SCHEDULER),
        ),
        _scenario(
            "agent-kill-idle",
            "kill -9 an agent that runs nothing.",
            FaultSpec(kind=FaultKind.KILL, target=Target.AGENT_IDLE),
            load={"rate": 1.0},
        ),
        _scenario(
            "agent-kill-busy",
            "kill -9 the busiest agent: its requests are rescued elsewhere.",
            FaultSpec(kind=FaultKind.KILL, target=Target.AGENT),
            load={"output_tokens": 96},
            verdicts={"expect_rescue": True},
        ),
        _scenario(
            "torch-agent-kill",
            "kill -9 the busiest of two torch `tiny` agents: its requests are rescued elsewhere and every "
            "greedy answer equals the no-fault one.",
            FaultSpec(kind=FaultKind.KILL, target=Target.AGENT),
            # paced: a 400-token request lasts >= 2 s, so requests still run when the kill lands
            cluster={"engine": "torch", "instances": 2, "min_step_s": 0.005},
            load={"rate": 3.0, "output_tokens": 400},
            phases={"steady_s": 3.0, "fault_s": 1.0, "recovery_s": 3.0},
            verdicts={"expect_rescue": True},
        ),
        _scenario(
            "agent-kill-source",
            "kill -9 the source of a migration mid-stage.",
            FaultSpec(kind=FaultKind.KILL, target=Target.MIGRATION_SOURCE, **_MIGRATION_FAULT),
            cluster=_MIGRATING,
        ),
        _scenario(
            "agent-kill-destination",
            "kill -9 the destination of a migration mid-stage.",
            FaultSpec(kind=FaultKind.KILL, target=Target.MIGRATION_DESTINATION, **_MIGRATION_FAULT),
            cluster=_MIGRATING,
        ),
        _scenario(
            "agent-stop",
            "SIGSTOP the busiest agent for the fault phase, then SIGCONT.",
            FaultSpec(kind=FaultKind.STOP, target=Target.AGENT),
        ),
        _scenario(
            "agent-term-migrating",
            "SIGTERM the source of a migration: it drains (moves its requests away live), then leaves.",
            FaultSpec(kind=FaultKind.TERM, target=Target.MIGRATION_SOURCE, **_MIGRATION_FAULT),
            cluster={"copy_delay_s": 0.1},
            load={"output_tokens": 128, "rate": 3.0},
            verdicts={"expect_migration_commit": True, "expect_no_recompute": True},
        ),
        _scenario(
            "frontend-restart",
            "kill -9 the frontend; a new one serves after 1 s (clients of the dead one got clean errors).",
            FaultSpec(kind=FaultKind.KILL, target=Target.FRONTEND),
            load={"output_tokens": 64},
            verdicts={"expect_errors": True},
        ),
        _scenario(
            "frontend-kill",
            "kill -9 the frontend mid-stream: its clients' requests fail cleanly and the agents abort "
            "them (nobody listens any more) long before they would have finished.",
            FaultSpec(kind=FaultKind.KILL, target=Target.FRONTEND, restart_after_s=None),
            cluster={"time_scale": 60.0},
            load={"output_tokens": 150, "rate": 2.0},
            phases={"steady_s": 3.0, "fault_s": 1.0, "recovery_s": 1.0},
            verdicts={"expect_errors": True, "expect_recovery": False, "max_orphan_s": 8.0},
        ),
        _scenario(
            "nats-kill",
            "kill -9 the nats-server, start it again on its file store after 1 s.",
            FaultSpec(kind=FaultKind.KILL, target=Target.NATS),
        ),
        _scenario(
            "nats-restart",
            "Stop the nats-server (SIGTERM) and start it again on its file store.",
            FaultSpec(kind=FaultKind.RESTART, target=Target.NATS),
        ),
        _scenario(
            "nats-stop",
            "SIGSTOP the nats-server for 2 s (hung, not dead), then SIGCONT.",
            FaultSpec(kind=FaultKind.STOP, target=Target.NATS),
            phases={"fault_s": 2.0},
        ),
        _scenario(
            "bus-latency",
            "200 ms added to every chunk between the components and NATS.",
            FaultSpec(kind=FaultKind.LATENCY, target=Target.BUS, latency_ms=200),
            phases={"fault_s": 5.0},
        ),
        _scenario(
            "bus-blackhole",
            "Nothing passes between the components and NATS for 2 s.",
            FaultSpec(kind=FaultKind.BLACKHOLE, target=Target.BUS),
            phases={"fault_s": 2.0},
        ),
        _scenario(
            "bus-reset",
            "Every connection to NATS is reset.",
            FaultSpec(kind=FaultKind.RESET, target=Target.BUS),
            phases={"fault_s": 1.0},
        ),
        _scenario(
            "agent-partition",
            "The busiest agent is cut off from NATS for 5 s (its own link blackholed): it is declared "
            "failed and its requests are rescued elsewhere; once the link heals it stays out of service "
            "(nothing restarts it, and it does not announce itself again).",
            FaultSpec(kind=FaultKind.BLACKHOLE, target=Target.AGENT_BUS),
            load={"output_tokens": 96},
            phases={"fault_s": 5.0},
            verdicts={"expect_rescue": True},
        ),
        _scenario(
            "kv-blackhole",
            "The KV transport forwards nothing during a migration: the migration "
            "aborts, the request continues on its source.",
            FaultSpec(kind=FaultKind.BLACKHOLE, target=Target.KV, **_MIGRATION_FAULT),
            # the copy times out after 2 s: its request has to outlive that, on any engine. Steps of
            # at least 32 ms make a 128-token request last over 4 s (the sim's own steps here are
            # 14-27 ms; a small model on a real engine steps in a few ms and would finish first)
            cluster={"copy_delay_s": 0.3, "copy_timeout_s": 2.0, "min_step_s": 0.032},
            load={"output_tokens": 128, "rate": 3.0},
            phases={"fault_s": 4.0},
            verdicts={"expect_migration_abort": True, "expect_no_recompute": True},
        ),
        _scenario(
            "handshake-loss",
            "Each agent loses its first outgoing Ack and repeats its first Commit (the agents' fault plan) "
            "while migrations run: the lost Ack times the migration out, the repeated Commit is ignored.",
            FaultSpec(kind=FaultKind.MIGRATIONS),
            cluster={"copy_delay_s": 0.1, "handshake_faults": ["drop:out:Ack", "duplicate:out:Commit"]},
            load={"output_tokens": 128, "rate": 3.0},
            phases={"fault_s": 6.0},
            verdicts={"expect_migration_abort": True, "expect_migration_commit": True},
        ),
        _scenario(
            "all-agents-kill",
            "kill -9 every agent under load: requests no instance can take fail within the frontend's "
            "bound with its error, the agents come back by supervision and later requests complete.",
            FaultSpec(kind=FaultKind.KILL, target=Target.AGENTS),
            # restarted 6 s after the kill: the requests in flight see no instance for longer than
            # the frontend takes to notice (3 s) plus its 2 s bound, so they end with its error
            cluster={"instances": 2, "supervise": True, "restart_delay_s": 6.0, "rescue_timeout_s": 2.0},
            load={"output_tokens": 96, "request_timeout_s": 30.0},
            phases={"steady_s": 4.0, "fault_s": 1.0, "recovery_s": 5.0},
            verdicts={"expect_errors": True, "expect_supervised_return": True},
        ),
        _scenario(
            "agent-crash-loop",
            "kill -9 the busiest agent each time its supervisor brings it back: it is left down, the "
            "others serve, its requests are rescued there and none is lost.",
            FaultSpec(kind=FaultKind.CRASH_LOOP, target=Target.AGENT),
            # left down at its third exit within a minute (restarted after 1 s, then 2 s)
            cluster={"supervise": True, "max_restarts": 3, "rescue_timeout_s": 5.0},
            load={"output_tokens": 96, "request_timeout_s": 30.0},
            phases={"steady_s": 4.0, "fault_s": 0.0, "recovery_s": 4.0},
            verdicts={"expect_rescue": True, "expect_left_down": True},
        ),
        _scenario(
            "engine-cannot-step",
            "Two of four agents' engines fail at their first step (one raises, one's process dies): "
            "they are never ready, never given a request and left down; the other two serve.",
            FaultSpec(kind=FaultKind.FIRST_STEP),
            # each is left down at its third exit within a minute (restarted after 1 s, then 2 s)
            cluster={"instances": 4, "supervise": True, "max_restarts": 3, "rescue_timeout_s": 5.0,
                     "first_step_faults": {2: "raise", 3: "exit"}},
            load={"request_timeout_s": 30.0},
            phases={"steady_s": 3.0, "fault_s": 3.0, "recovery_s": 3.0},
            verdicts={"expect_left_down": True},
        ),
        _scenario(
            "rolling-restart",
            "SIGTERM each agent in turn under load; each drains by live migration "
            "and a new one takes its place: nothing recomputed, nothing lost.",
            FaultSpec(kind=FaultKind.ROLLING_RESTART),
            load={"output_tokens": 96, "rate": 3.0},
            phases={"fault_s": 0.0},
            verdicts={"expect_no_recompute": True, "expect_migration_commit": True},
        ),
    ]
}

#: The suite ``shoal drill all`` runs (every built-in scenario).
FULL_SUITE: tuple[str, ...] = tuple(BUILTIN)
#: A few scenarios that cover the process, bus and drain paths quickly (the test suite runs these).
CI_SUITE: tuple[str, ...] = ("scheduler-kill", "torch-agent-kill", "bus-blackhole", "agent-term-migrating")


def _field_path(location: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in location) or "(top level)"


def validate(data: object, source: str) -> Scenario:
    """A :class:`Scenario` from plain data; errors name the field (``load.rate: ...``)."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ScenarioError(f"{source}: {problems}") from None


def load_scenario(path: Path) -> Scenario:
    """A scenario from a TOML or YAML file (the fields of :class:`Scenario`; ``name``: the file's stem)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    data: object
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ScenarioError(f"{path}: YAML scenarios need the 'pyyaml' package (or write TOML)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a table of scenario fields at the top level")
    data.setdefault("name", path.stem)
    return validate(data, str(path))


def resolve(name_or_path: str) -> list[Scenario]:
    """Scenarios for a command-line argument: a built-in name, ``all``, ``ci`` or a TOML / YAML file."""
    if name_or_path == "all":
        return [BUILTIN[n] for n in FULL_SUITE]
    if name_or_path == "ci":
        return [BUILTIN[n] for n in CI_SUITE]
    if name_or_path in BUILTIN:
        return [BUILTIN[name_or_path]]
    path = Path(name_or_path)
    if path.suffix in (".toml", ".yaml", ".yml") or path.exists():
        return [load_scenario(path)]
    raise ScenarioError(
        f"unknown scenario {name_or_path!r}: a built-in ({', '.join(BUILTIN)}), 'all', 'ci' "
        "or a .toml or .yaml file"
    )
