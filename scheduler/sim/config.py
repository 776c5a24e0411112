"""Frozen configuration of one simulation: the cluster, the named policies, the migration model.

Built once at the entry point (``shoal simulate`` or a test) and passed down;
nothing below reads the environment. The named policies of ``--policy`` map to
a :class:`PolicySetup`:

================  ============================  ===========  ===============
name              dispatch                      migration    priorities
================  ============================  ===========  ===============
``rr``            round-robin                   no           no
``infaas``        INFaaS++ (least memory load)  no           no
``llumnix-base``  freeness (the paper)          yes          no (all normal)
``llumnix``       freeness (the paper)          yes          yes (headroom)
``kv``            Dynamo's KV router cost       no           no
                  (``kv``)
``prefix``        llm-d's prefix, queue and     no           no
                  KV-utilisation scorers
``shoal``         ``prefill_ahead``             yes, with    yes (headroom)
                  (the default)                 room check
``shoal-cost``    ``predicted_ttft`` (shoal's   yes, with    yes (headroom)
                  cost model over the cache)    room check
================  ============================  ===========  ===============

``kv`` and ``prefix`` are the KV-aware routers a user would run instead (they read the prefix
index's ``PendingRequest.cached_tokens``; neither can move a request once placed).
``shoal`` is the default policy, live and here: :data:`DispatchPolicy.PREFILL_AHEAD
<scheduler.config.DispatchPolicy>` dispatch, :func:`~scheduler.config.shoal_pairing`
(pairs only destinations with room, sends only what fits, no retry of an aborted
request for 2 s, at most 3 moves per request) and the move of queued requests after
:data:`~scheduler.config.SHOAL_REQUEUE_AFTER_S` (``PolicySetup.requeue_after_s``; no other
policy moves queued requests). ``shoal-cost`` is the same with the cost-model dispatch
(:data:`DispatchPolicy.PREDICTED_TTFT <scheduler.config.DispatchPolicy>`).

"Priorities no" means every request is submitted with the normal priority,
to the policies and to the engines alike (the paper's baselines have none);
the metrics still group requests by the class the workload gave them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from agents.engines.profile import EngineProfile, load_profile
from agents.migration.fsm.config import MigrationConfig
from scheduler.config import (
    DEFAULT_PRIORITY_CLASSES,
    SHOAL_REQUEUE_AFTER_S,
    DispatchPolicy,
    PairingConfig,
    PolicyConfig,
    PriorityClass,
    ScalingConfig,
    shoal_pairing,
)

__all__ = [
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "MigrationModel",
    "PolicyName",
    "PolicySetup",
    "SimConfig",
    "policy_setup",
]

#: Default KV-copy bandwidth between two instances: 10 GB/s, what Gloo/NCCL reach over
#: PCIe 4.0 between A10s in one host (docs/simulation.md says more).
DEFAULT_BANDWIDTH_BYTES_PER_S = 10e9


class PolicyName(enum.StrEnum):
    """The ``--policy`` choices."""

    ROUND_ROBIN = "rr"
    INFAAS = "infaas"
    LLUMNIX_BASE = "llumnix-base"
    LLUMNIX = "llumnix"
    KV = "kv"
    PREFIX = "prefix"
    SHOAL = "shoal"
    SHOAL_COST = "shoal-cost"


@dataclass(frozen=True, slots=True)
class PolicySetup:
    """A named policy resolved: the policy core's config, whether it migrates and honours priorities,
    and after how long a stalled queue gives up a queued request (None: never)."""

    name: PolicyName
    policy: PolicyConfig
    migrate: bool
    priorities: bool
    requeue_after_s: float | None = None


_DISPATCH: dict[PolicyName, DispatchPolicy] = {
    PolicyName.ROUND_ROBIN: DispatchPolicy.ROUND_ROBIN,
    PolicyName.INFAAS: DispatchPolicy.INFAAS,
    PolicyName.LLUMNIX_BASE: DispatchPolicy.FREENESS,
    PolicyName.LLUMNIX: DispatchPolicy.FREENESS,
    PolicyName.KV: DispatchPolicy.KV,
    PolicyName.PREFIX: DispatchPolicy.PREFIX,
    PolicyName.SHOAL: DispatchPolicy.PREFILL_AHEAD,
    PolicyName.SHOAL_COST: DispatchPolicy.PREDICTED_TTFT,
}
#: The policies built on shoal's pairing, priorities and moves of queued requests.
_SHOAL_FAMILY = (PolicyName.SHOAL, PolicyName.SHOAL_COST)


def policy_setup(
    name: PolicyName | str,
    *,
    pairing: PairingConfig | None = None,
    scaling: ScalingConfig | None = None,
    priority_classes: tuple[PriorityClass, ...] = DEFAULT_PRIORITY_CLASSES,
    dispatch: DispatchPolicy | None = None,
) -> PolicySetup:
    """The setup of a named policy; ``dispatch`` overrides its dispatch rule (e.g. shoal's
    migration with the paper's freeness dispatch).

    ``pairing`` None: the policy's own band (the paper's 3, 30; ``shoal``: 3, 60).
    """
    kind = PolicyName(name)
    if kind in _SHOAL_FAMILY:
        pairing = (
            shoal_pairing() if pairing is None
            else shoal_pairing(pairing.low_freeness, pairing.high_freeness, pairing.target_freeness)
        )
    elif pairing is None:
        pairing = PairingConfig()
    config = PolicyConfig(
        priority_classes=priority_classes,
        dispatch_policy=_DISPATCH[kind] if dispatch is None else dispatch,
        pairing=pairing,
        scaling=ScalingConfig() if scaling is None else scaling,
    )
    return PolicySetup(
        name=kind,
        policy=config,
        migrate=kind in (PolicyName.LLUMNIX_BASE, PolicyName.LLUMNIX, *_SHOAL_FAMILY),
        priorities=kind in (PolicyName.LLUMNIX, *_SHOAL_FAMILY),
        requeue_after_s=(
            SHOAL_REQUEUE_AFTER_S
            if kind in _SHOAL_FAMILY and config.dispatch_policy.moves_queued
            else None
        ),
    )


@dataclass(frozen=True, slots=True)
class MigrationModel:
    """The time a migration's steps take, and the protocol's configuration.

    The agents' state machines (:mod:`agents.migration.fsm`, with ``config``)
    decide the stages, the suspend and every abort; this model only says how
    long things take on the virtual clock:

    * ``handshake_latency_s`` — a message's round trip between two agents; one
      handshake message (``PreAllocate``, ``Ack``, ``StageWritten``,
      ``Commit``, ``CommitAck``, ``Abort``) takes half of it (:attr:`message_s`);
    * ``bytes / bandwidth_bytes_per_s`` — a stage's data, from the source's
      export to its landing at the destination (:meth:`copy_s`);
    * ``commit_latency_s`` — a claim of the outcome in the event log, from the
      append to its answer.

    So a stage takes ``1.5 handshakes + copy`` (pre-allocate, ack, copy, the
    destination's written-confirmation), and a migration's downtime (suspend to
    admission at the destination) is the last stage plus the ``Commit``
    message and the destination's claim: ``2 handshakes + copy + commit latency``.
    """

    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S
    handshake_latency_s: float = 0.002
    commit_latency_s: float = 0.005
    config: MigrationConfig = field(default_factory=MigrationConfig)

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be > 0")
        if self.handshake_latency_s < 0 or self.commit_latency_s < 0:
            raise ValueError("latencies must be >= 0")

    @property
    def message_s(self) -> float:
        """Seconds one handshake message takes to reach the peer."""
        return self.handshake_latency_s / 2

    def copy_s(self, num_blocks: int, bytes_per_block: int) -> float:
        """Seconds to copy ``num_blocks`` blocks (no handshake)."""
        return num_blocks * bytes_per_block / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated cluster and how it is driven.

    * ``report_interval_s``: agents report their load this often (virtual time),
      and only when something changed since their last report;
    * ``pairing_interval_s``: the scheduler pairs instances this often;
    * ``scaling_interval_s``: the scheduler evaluates auto-scaling this often
      (when ``autoscale``); a launched instance joins ``startup_delay_s`` later;
    * ``sample_interval_s``: fragmentation and instance counts are sampled this often;
    * ``max_virtual_s``: give up (and say so) past this much virtual time;
    * ``max_step_tokens``: the engines' per-step token budget (chunked prefill, as vLLM V1
      and the torch engine run it); None: every admitted prompt prefills in one step;
    * ``requeue_after_s``: the move of queued requests (no KV: the request moves, not its
      cache) off an instance whose head of line waited this long, to one where it starts at
      once (dispatch rules whose scores say so: ``prefill_ahead``); None (the default): the policy's
      own (``PolicySetup.requeue_after_s``: 0.5 s for ``shoal``, off for the rest); 0: off.
      :attr:`requeue_s` is what the run uses;
    * ``prefix_cache``: the engines' automatic prefix caching (off by default here, so that runs
      built in code keep their accounting; ``shoal simulate`` turns it on);
    * ``slo``: ``(TTFT, TPOT)`` bounds in seconds a request must meet (the result's
      ``slo_attainment``; a sweep derives them from an unloaded run); None: not judged;
    * ``cores``: CPU cores the instances share (a CPU cluster on one machine): while ``n``
      instances compute a step, each progresses at ``min(1, cores / n)`` of its profile's speed
      (processor sharing); None: each instance has hardware of its own;
    * ``record_policy_log`` / ``record_migrations``: keep the policy layer's
      inputs and decisions / every finished migration with its machines'
      records (for tests and replays).
    """

    setup: PolicySetup = field(default_factory=lambda: policy_setup(PolicyName.SHOAL))
    profile: EngineProfile = field(default_factory=lambda: load_profile("llama-7b-a10"))
    num_instances: int = 16
    migration: MigrationModel = field(default_factory=MigrationModel)
    report_interval_s: float = 0.1
    pairing_interval_s: float = 0.1
    autoscale: bool = False
    scaling_interval_s: float = 1.0
    startup_delay_s: float = 20.0
    sample_interval_s: float = 1.0
    max_virtual_s: float = 1e6
    max_step_tokens: int | None = None
    requeue_after_s: float | None = None
    prefix_cache: bool = False
    slo: tuple[float, float] | None = None
    cores: int | None = None
    record_policy_log: bool = False
    record_migrations: bool = False

    def __post_init__(self) -> None:
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1 or None, got {self.cores}")
        if self.num_instances < 1:
            raise ValueError("num_instances must be >= 1")
        for name in ("report_interval_s", "pairing_interval_s", "scaling_interval_s", "sample_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.startup_delay_s < 0:
            raise ValueError("startup_delay_s must be >= 0")
        if self.requeue_after_s is not None and self.requeue_after_s < 0:
            raise ValueError(f"requeue_after_s must be >= 0 (0: off) or None, got {self.requeue_after_s}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1 or None, got {self.max_step_tokens}")

    @property
    def requeue_s(self) -> float | None:
        """The run's ``requeue_after_s``: the override, else the policy's own; None when off."""
        after = self.setup.requeue_after_s if self.requeue_after_s is None else self.requeue_after_s
        return after if after else None
