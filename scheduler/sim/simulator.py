"""The discrete-event cluster simulator: N sim engines, the live policies, a virtual clock.

One event heap, ordered by (virtual time, insertion order), no sleeps, no bus:

* **arrival** — the request goes to :meth:`PolicyLayer.dispatch` (the live
  dispatcher over the folded load views); a prompt no instance could ever
  hold is rejected and counted; with no instance live it waits for one. Its
  prompt's token ids are built when it is placed (:mod:`scheduler.sim.prompts`);
* **turn** — a session's next turn arrives a think time after the previous
  turn's last token, its prompt holding that turn's prompt and answer;
* **step end** — an instance's step, planned with ``begin_step`` when it
  started, completes (tokens, finished requests, preemptions); the next step
  is planned at once while the instance has work;
* **report tick** (``report_interval_s``) — every instance whose state
  changed builds a load report; the batch is folded into the scheduler's state;
  with the prefix cache on, each engine's cache delta since the last tick
  (``take_cache_delta``) is folded into the scheduler's
  :class:`~scheduler.prefix_index.PrefixIndex` as the batch its agent would
  publish, so a dispatch sees, per instance, the leading blocks of the
  request's chain it caches (``PendingRequest.cached_tokens``, filled by
  :func:`~scheduler.prefix_index.prefix_hits` as the live scheduler fills it);
* **pairing tick** (``pairing_interval_s``, migrating policies) — the
  scheduler pairs instances; each source in a pair picks requests with
  :func:`~scheduler.policy.select_requests_to_migrate` toward the pair's
  target freeness and migrates them (see :mod:`scheduler.sim.migration`);
* **migration** — a handshake message, a stage's data, a log answer or a
  deadline reaches one side of a migration, whose state machine (the agents'
  own, :mod:`agents.migration.fsm`) takes the next step;
* **scaling tick** (``scaling_interval_s``, with ``autoscale``) — the
  scheduler decides; a launched instance joins ``startup_delay_s`` later, a
  terminating one drains (by migration where the policy migrates) and leaves;
* **sample tick** (``sample_interval_s``) — fragmentation and instances held.

The engine, local scheduler, virtual usage, dispatch, pairing, selection and
scaling are the shared code, imported; this module only moves time and data
between them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from agents.engines.protocol import RequestRejected
from agents.engines.sim import SimEngine, sim_token_id
from scheduler.policy import (
    Pairing,
    PendingRequest,
    ScaleDownDecision,
    ScaleUpDecision,
    order_pending,
)
from scheduler.prefix_index import PrefixIndex, prefix_hits
from scheduler.sim.config import SimConfig
from scheduler.sim.event_kinds import EventKind
from scheduler.sim.instance import SimInstance
from scheduler.sim.metrics import RequestRecord, SimResult, fragmentation_share, summarize
from scheduler.sim.migration import MigrationDriver
from scheduler.sim.policy_layer import PolicyLayer, PolicyLog
from scheduler.sim.prompts import prompt_token_ids
from scheduler.sim.workload import SimRequest, Workload
from schemas import SamplingParams
from schemas.block_hash import block_hashes
from schemas.instance import InstanceLeft
from schemas.kv_events import KVCacheEvents
from schemas.reasons import MigrationAbortReason

__all__ = ["SimulationIncomplete", "Simulator", "simulate"]

ARRIVAL, STEP_END, REPORT, PAIR, SCALE, SAMPLE, MIGRATION, READY, TURN = (
    EventKind.ARRIVAL, EventKind.STEP_END, EventKind.REPORT, EventKind.PAIR, EventKind.SCALE,
    EventKind.SAMPLE, EventKind.MIGRATION, EventKind.READY, EventKind.TURN,
)

ProgressCallback = Callable[[int, int, float], None]


class SimulationIncomplete(RuntimeError):
    """The run passed ``max_virtual_s`` with requests unfinished."""


class Simulator:
    """One run over one workload. Build, call :meth:`run` once."""

    def __init__(
        self, config: SimConfig, workload: Workload, *, on_progress: ProgressCallback | None = None
    ) -> None:
        self.config = config
        self.setup = config.setup
        self.policy = config.setup.policy
        self.workload = workload
        self.on_progress = on_progress
        self.log = PolicyLog() if config.record_policy_log else None
        self.layer = PolicyLayer(self.policy, log=self.log)
        self.instances: dict[str, SimInstance] = {}
        self.records: dict[str, RequestRecord] = {}
        self.now = 0.0
        self.unplaced: list[PendingRequest] = []
        self.num_done = 0
        self.num_rejected = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._counter = itertools.count()
        self._next_instance = 0
        self._launching: dict[str, float] = {}
        self._held: list[tuple[float, float]] = []  # (launched, left) of departed instances
        self.joins: list[tuple[str, float, float]] = []  # (instance id, launched, joined)
        self.fragmentation_series: list[tuple[float, float]] = []
        self.instances_series: list[tuple[float, int]] = []
        self.migrations = MigrationDriver(self, config.migration, record=config.record_migrations)
        self._by_id: dict[str, SimRequest] = {r.request_id: r for r in workload.requests}
        self._queued_at: dict[str, float] = {}  # request id -> when it was placed on its instance
        self._requeued: set[str] = set()  # requests moved once while queued (requeue_after_s)
        requests = workload.requests
        #: the requests whose arrival is set in advance, by arrival
        self._opening = sorted(
            (k for k, r in enumerate(requests) if not r.follows), key=lambda k: requests[k].arrival_s
        )
        #: request id -> index of the turn that follows it
        self._next_turn: dict[str, int] = {r.follows: k for k, r in enumerate(requests) if r.follows}
        self._prompts: dict[str, list[int]] = {}  # prompts of requests with a next turn, until they end
        self._contexts: dict[str, list[int]] = {}  # request id -> prompt and answer its next turn starts with
        self.num_turns_dropped = 0  # later turns of sessions whose earlier turn was rejected
        #: instance id -> [prompt tokens, of those served from its prefix cache] at first admission
        self.prompt_tokens_by_instance: dict[str, list[int]] = {}
        self._evictions: dict[str, int] = {}  # departed instance id -> its prefix-cache evictions
        #: sharing cores (``config.cores``): instance id -> [profile s left, since, version, started]
        self._sharing: dict[str, list[float]] = {}
        self._core_rate = 1.0
        #: instance id -> running requests summed over the sample ticks (the spread of the load)
        self.running_samples: dict[str, int] = {}
        #: the scheduler's prefix index, fed each report tick with the engines' cache deltas
        self.prefix = PrefixIndex()
        self._kv_batches: dict[str, int] = {}  # instance id -> its last cache batch's seq
        self._tokens: dict[str, list[int]] = {}  # request id -> prompt token ids, until placed
        self._chains: dict[str, list[int]] = {}  # request id -> its prompt's block-hash chain, until placed

    # ------------------------------------------------------------ plumbing

    def push(self, at: float, kind: int, payload: Any = None) -> None:
        heapq.heappush(self._heap, (at, next(self._counter), kind, payload))

    def _new_instance_id(self) -> str:
        instance_id = f"i{self._next_instance:03d}"
        self._next_instance += 1
        return instance_id

    def _join(self, instance_id: str, launched_s: float) -> SimInstance:
        config = self.config
        engine = SimEngine(
            config.profile, max_step_tokens=config.max_step_tokens, prefix_cache=config.prefix_cache
        )
        instance = SimInstance(instance_id, engine, launched_s=launched_s, joined_s=self.now)
        self.instances[instance_id] = instance
        self.joins.append((instance_id, launched_s, self.now))
        return instance

    def _leave(self, instance: SimInstance) -> None:
        del self.instances[instance.instance_id]
        self.prefix.drop(instance.instance_id)
        self._kv_batches.pop(instance.instance_id, None)
        self._evictions[instance.instance_id] = instance.engine.scheduler.blocks.num_evictions
        self._held.append((instance.launched_s, self.now))
        self.layer.fold((InstanceLeft(instance_id=instance.instance_id),))
        self.migrations.instance_left(instance.instance_id)

    # ------------------------------------------------------------ what migration uses (MigrationHost)

    def instance(self, instance_id: str) -> SimInstance | None:
        return self.instances.get(instance_id)

    def pairings(self) -> Sequence[Pairing]:
        return sorted(self.layer.state.pairings.values(), key=lambda p: p.source_id)

    def wake(self, instance_id: str) -> None:
        instance = self.instances.get(instance_id)
        if instance is not None:
            self.kick(instance)

    def leave_if_drained(self, instance_id: str) -> None:
        instance = self.instances.get(instance_id)
        if instance is not None and instance.terminating and instance.is_drained():
            self._leave(instance)

    def count_migration(self, request_id: str) -> None:
        self.records[request_id].num_migrations += 1

    def done(self) -> bool:
        return self.num_done >= len(self.workload.requests)

    # ------------------------------------------------------------ run

    def run(self) -> SimResult:
        started = time.perf_counter()
        config = self.config
        joined = [self._join(self._new_instance_id(), 0.0) for _ in range(config.num_instances)]
        self.layer.fold(tuple(inst.joined for inst in joined))
        requests = self.workload.requests
        if self._opening:
            self.push(requests[self._opening[0]].arrival_s, ARRIVAL, 0)
        self.push(config.report_interval_s, REPORT, 1)
        if self.setup.migrate:
            self.push(config.pairing_interval_s, PAIR, 1)
        if config.autoscale:
            self.push(config.scaling_interval_s, SCALE, 1)
        self.push(0.0, SAMPLE, 0)
        handlers: dict[int, Callable[[Any], None]] = {
            ARRIVAL: self._on_arrival,
            STEP_END: self._on_step_end,
            REPORT: self._on_report,
            PAIR: self._on_pair,
            SCALE: self._on_scale,
            SAMPLE: self._on_sample,
            MIGRATION: self.migrations.on_delivery,
            READY: self._on_ready,
            TURN: self._on_turn,
        }
        heap = self._heap
        pop = heapq.heappop
        total = len(requests)
        while heap and self.num_done < total:
            at, _, kind, payload = pop(heap)
            if at > config.max_virtual_s:
                raise SimulationIncomplete(
                    f"{total - self.num_done} of {total} requests unfinished after {config.max_virtual_s} s"
                )
            self.now = at
            handlers[kind](payload)
        if self.num_done < total:
            raise SimulationIncomplete(f"{total - self.num_done} of {total} requests never finished")
        self._on_sample(None, reschedule=False)
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> SimResult:
        end = self.now
        held = sum(left - launched for launched, left in self._held)
        held += sum(end - inst.launched_s for inst in self.instances.values())
        held += sum(end - launched for launched in self._launching.values())
        config = self.config
        setup = self.setup
        parameters: dict[str, object] = {
            "policy": setup.name.value,
            "dispatch": setup.policy.dispatch_policy.value,
            "migrate": setup.migrate,
            "priorities": setup.priorities,
            "profile": config.profile.name,
            "instances": config.num_instances,
            "pairing_low_high": [setup.policy.pairing.low_freeness, setup.policy.pairing.high_freeness],
            "bandwidth_bytes_per_s": config.migration.bandwidth_bytes_per_s,
            "report_interval_s": config.report_interval_s,
            "pairing_interval_s": config.pairing_interval_s,
            "autoscale": config.autoscale,
            "max_step_tokens": config.max_step_tokens,
            "requeue_after_s": config.requeue_s,
            "prefix_cache": config.prefix_cache,
        }
        if config.autoscale:
            scaling = setup.policy.scaling
            parameters["scaling_band"] = [scaling.min_freeness, scaling.max_freeness]
            parameters["scaling_instances"] = [scaling.min_instances, scaling.max_instances]
            parameters["startup_delay_s"] = config.startup_delay_s
        return summarize(
            records=list(self.records.values()),
            record_ids=list(self.records),
            policy=self.policy,
            policy_name=setup.name.value,
            workload=self.workload.description,
            credit=self.workload.credit,
            num_instances=config.num_instances,
            rejected=self.num_rejected,
            migrations=self.migrations.num_committed,
            migrations_aborted=self.migrations.num_aborted,
            migrations_started=self.migrations.num_started,
            migration_abort_reasons=dict(sorted(self.migrations.abort_reasons.items())),
            migration_bytes=self.migrations.bytes_total,
            paced_copies=self.migrations.num_paced,
            hurried_copies=self.migrations.num_hurried,
            downtime_total_s=self.migrations.downtime_total_s,
            fragmentation_series=self.fragmentation_series,
            instances_series=self.instances_series,
            instance_seconds=held,
            virtual_s=end,
            wall_s=wall_s,
            parameters=parameters,
            warnings=self._warnings(),
            requeues=len(self._requeued),
            prefix_cache=config.prefix_cache,
            prompt_tokens_by_instance=self.prompt_tokens_by_instance,
            evictions_by_instance=self._evictions_by_instance(),
            slo=config.slo,
            migration_bytes_saved=self.migrations.bytes_saved,
            running_samples=self.running_samples,
            prefix_groups=self._prefix_groups(),
        )

    def _prefix_groups(self) -> dict[str, int]:
        """Request id -> 1 for the requests opening with the workload's most common first prompt
        segment (a hot system prompt), when at least a tenth of the requests and twice the mean
        share of a first segment open with it; else empty."""
        requests = self.workload.requests
        firsts = [r.segments[0] for r in requests if r.segments]
        if not firsts:
            return {}
        counts: dict[tuple[int, int], int] = {}
        for first in firsts:
            counts[first] = counts.get(first, 0) + 1
        hot, count = max(counts.items(), key=lambda item: item[1])
        if count < max(2, len(requests) // 10, 2 * len(firsts) // len(counts)):
            return {}  # no prompt stands out: twice the mean prompt's share and a tenth of all
        return {r.request_id: 1 for r in requests if r.segments and r.segments[0] == hot}

    def _warnings(self) -> tuple[str, ...]:
        if not self.num_turns_dropped:
            return self.workload.warnings
        return (*self.workload.warnings, (
            f"{self.num_turns_dropped} later turns of sessions whose turn was rejected were never sent: "
            "counted as rejected"
        ))

    def _evictions_by_instance(self) -> dict[str, int]:
        evictions = dict(self._evictions)
        for instance_id, instance in self.instances.items():
            evictions[instance_id] = instance.engine.scheduler.blocks.num_evictions
        return evictions

    # ------------------------------------------------------------ requests

    def _on_arrival(self, position: int) -> None:
        requests = self.workload.requests
        opening = self._opening
        request = requests[opening[position]]
        self._arrive(request, request.arrival_s)
        if position + 1 < len(opening):
            self.push(requests[opening[position + 1]].arrival_s, ARRIVAL, position + 1)

    def _on_turn(self, index: int) -> None:
        self._arrive(self.workload.requests[index], self.now)

    def _arrive(self, request: SimRequest, at: float) -> None:
        self.records[request.request_id] = RequestRecord(at, request.priority)
        tokens = self._prompt(request)
        self._tokens[request.request_id] = tokens
        if self.config.prefix_cache:
            self._chains[request.request_id] = block_hashes(tokens, self.config.profile.block_size)
        pending = PendingRequest(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            priority=request.priority if self.setup.priorities else 0,
            arrival=at,
        )
        self._place(pending, request)

    def _reject(self, request_id: str) -> None:
        self.num_rejected += 1
        self.num_done += 1
        self.records[request_id].finish_s = -2.0
        self._prompts.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._chains.pop(request_id, None)
        self._contexts.pop(self._by_id[request_id].follows, None)
        requests = self.workload.requests
        while request_id in self._next_turn:  # the rest of its session is never sent
            request = requests[self._next_turn.pop(request_id)]
            request_id = request.request_id
            self.records[request_id] = RequestRecord(self.now, request.priority)
            self.records[request_id].finish_s = -2.0
            self.num_rejected += 1
            self.num_done += 1
            self.num_turns_dropped += 1

    def _prompt(self, request: SimRequest) -> list[int]:
        """The request's prompt token ids (a session's turn: the previous turn's prompt and answer first)."""
        context = self._contexts.pop(request.follows, []) if request.follows else []
        if request.context_tokens is not None:
            context = context[: request.context_tokens]
        tokens = prompt_token_ids(
            request.request_id, request.num_prompt_tokens, request.segments, self.config.profile.vocab_size,
            context,
        )
        if request.request_id in self._next_turn:
            self._prompts[request.request_id] = tokens
        return tokens

    def _send_next_turn(self, request_id: str, num_output_tokens: int) -> None:
        """A session's turn ended: its next turn arrives after the think time, holding this one's tokens."""
        index = self._next_turn.pop(request_id, None)
        if index is None:
            return
        profile = self.config.profile
        vocab, eos = profile.vocab_size, profile.eos_token_id
        context = self._prompts.pop(request_id)
        context.extend(sim_token_id(request_id, None, k, vocab, eos) for k in range(num_output_tokens))
        self._contexts[request_id] = context
        self.push(self.now + self.workload.requests[index].think_s, TURN, index)

    def cached_tokens(self, chain: Sequence[int]) -> tuple[tuple[str, int], ...]:
        """Per live instance holding the start of ``chain``, the prompt tokens its cache holds
        (what the prefix index says now; ``PendingRequest.cached_tokens``)."""
        if not chain:
            return ()
        block_size = self.config.profile.block_size
        hits = prefix_hits(self.prefix, chain, block_size=block_size, eligible=self.instances.__contains__)
        return tuple((instance_id, n * block_size) for instance_id, n in hits)

    def _place(self, pending: PendingRequest, request: SimRequest) -> None:
        fits = self.layer.can_ever_place(pending.num_prompt_tokens)
        if fits is False:
            self._reject(pending.request_id)
            return
        if fits:
            chain = self._chains.get(request.request_id)
            if chain:
                pending = msgspec.structs.replace(pending, cached_tokens=self.cached_tokens(chain))
        decision = self.layer.dispatch(pending) if fits else None
        if decision is None:
            self.unplaced.append(pending)
            return
        instance = self.instances[decision.instance_id]
        sampling = SamplingParams(max_tokens=request.num_output_tokens, ignore_eos=True)
        tokens = self._tokens.pop(request.request_id)
        self._chains.pop(request.request_id, None)
        try:
            instance.engine.add_request(request.request_id, tokens, sampling, pending.priority)
        except RequestRejected:
            self._reject(request.request_id)
            return
        instance.num_accepted += 1
        instance.request_ids[request.request_id] = None
        instance.dirty = True
        self._queued_at[request.request_id] = self.now
        self.kick(instance)

    def _requeue_stalled(self) -> None:
        """Move queued requests (no KV yet) off instances whose queue stalled (``requeue_after_s``).

        An instance stalls when its head of line has waited that long since it was placed there.
        Its newest queued request that never ran (the one that would wait longest; the head only
        when it is alone) goes where it would start at once, if anywhere
        (:meth:`PolicyLayer.requeue`); one per instance per report tick, once per request.
        """
        after = self.config.requeue_s
        if after is None:
            return
        for instance in list(self.instances.values()):
            scheduler = instance.engine.scheduler
            if instance.terminating or scheduler.num_waiting == 0:
                continue
            waiting = scheduler.waiting_requests()
            if not waiting or self.now - self._queued_at.get(waiting[0].request_id, self.now) < after:
                continue
            for queued in reversed(waiting[1:] or waiting):
                request_id = queued.request_id
                if request_id in self._requeued or queued.num_computed_tokens or queued.num_output_tokens:
                    continue  # moved before, or preempted after it ran: it stays
                request = self._by_id[request_id]
                prompt = queued.prompt_token_ids
                chain = (
                    block_hashes(prompt, self.config.profile.block_size) if self.config.prefix_cache else ()
                )
                pending = PendingRequest(
                    request_id=request_id, num_prompt_tokens=request.num_prompt_tokens,
                    priority=queued.priority, arrival=self.records[request_id].arrival_s,
                    cached_tokens=self.cached_tokens(chain),
                )
                decision = self.layer.requeue(pending, instance.instance_id)
                if decision is None:
                    break
                instance.engine.release_request(request_id)
                del instance.request_ids[request_id]
                instance.dirty = True
                self._requeued.add(request_id)
                self._place_on(self.instances[decision.instance_id], request, prompt, queued.priority)
                break

    def _place_on(
        self, instance: SimInstance, request: SimRequest, prompt: Sequence[int], priority: int
    ) -> None:
        sampling = SamplingParams(max_tokens=request.num_output_tokens, ignore_eos=True)
        instance.engine.add_request(request.request_id, prompt, sampling, priority)
        instance.num_accepted += 1
        instance.request_ids[request.request_id] = None
        instance.dirty = True
        self._queued_at[request.request_id] = self.now
        self.kick(instance)

    def _retry_unplaced(self) -> None:
        if not self.unplaced:
            return
        waiting, self.unplaced = self.unplaced, []
        for pending in order_pending(waiting):
            self._place(pending, self._by_id[pending.request_id])

    # ------------------------------------------------------------ steps

    def kick(self, instance: SimInstance) -> None:
        """Start the instance's next step if it is idle and has something to run."""
        if instance.plan is not None or not instance.request_ids:
            return
        plan, duration = instance.engine.begin_step()
        if plan.preempted:
            records = self.records
            for request_id in plan.preempted:
                record = records[request_id]
                record.num_preemptions += 1
                if record.preempted_at_s < 0:
                    record.preempted_at_s = self.now
                self.migrations.request_gone(
                    instance.instance_id, request_id, MigrationAbortReason.REQUEST_PREEMPTED
                )
        if plan.num_scheduled == 0:
            return
        instance.plan = plan
        instance.plan_duration_s = duration
        if self.config.cores is not None:
            self._sharing[instance.instance_id] = [duration, self.now, 0.0, self.now]
            self._share_cores()
            return
        self.push(self.now + duration, STEP_END, instance)

    def _share_cores(self) -> None:
        """Instances sharing ``config.cores`` CPU cores: the computing ones progress at
        ``min(1, cores / n)`` of their profile's speed, so every start or end of a step moves the
        ends of the others (an end pushed before is dropped by its version)."""
        now, rate = self.now, self._core_rate
        for entry in self._sharing.values():  # [profile seconds left, since, version, started]
            entry[0] -= (now - entry[1]) * rate
            entry[1] = now
        cores = self.config.cores or 1
        self._core_rate = rate = min(1.0, cores / len(self._sharing)) if self._sharing else 1.0
        for instance_id, entry in self._sharing.items():
            entry[2] += 1
            self.push(now + max(0.0, entry[0]) / rate, STEP_END, (self.instances[instance_id], entry[2]))

    def _on_step_end(self, payload: SimInstance | tuple[SimInstance, float]) -> None:
        if isinstance(payload, tuple):  # sharing cores: only the latest end pushed counts
            instance, version = payload
            entry = self._sharing.get(instance.instance_id)
            if entry is None or entry[2] != version:
                return
            del self._sharing[instance.instance_id]
            instance.plan_duration_s = self.now - entry[3]
            self._share_cores()
        else:
            instance = payload
        plan = instance.plan
        assert plan is not None
        instance.plan = None
        result = instance.engine.end_step(plan, instance.plan_duration_s)
        now = self.now
        records = self.records
        for output in result.outputs:
            record = records[output.request_id]
            if record.first_token_s < 0:
                record.first_token_s = now
                record.num_prompt_tokens = output.num_prompt_tokens
                record.num_cached_tokens = output.num_cached_tokens
                counts = self.prompt_tokens_by_instance.setdefault(instance.instance_id, [0, 0])
                counts[0] += output.num_prompt_tokens
                counts[1] += output.num_cached_tokens
            if record.preempted_at_s >= 0:
                record.preemption_loss_s += now - record.preempted_at_s
                record.preempted_at_s = -1.0
            if output.finish_reason is not None:
                record.finish_s = now
                record.num_output_tokens = output.first_index + 1
                instance.output_length.observe(output.first_index + 1)
                del instance.request_ids[output.request_id]
                self.num_done += 1
                self.migrations.request_gone(
                    instance.instance_id, output.request_id, MigrationAbortReason.REQUEST_FINISHED
                )
                self._send_next_turn(output.request_id, record.num_output_tokens)
        instance.dirty = True
        self.migrations.step_done(instance.instance_id)
        if instance.terminating and instance.is_drained():
            self._leave(instance)
            return
        self.kick(instance)

    # ------------------------------------------------------------ ticks

    def _on_report(self, tick: int) -> None:
        policy = self.policy
        reports = [inst.build_report(policy) for inst in self.instances.values() if inst.dirty]
        if reports:
            self.layer.fold(reports)
        if self.config.prefix_cache:
            self._fold_cache_deltas()
        self._retry_unplaced()
        self._requeue_stalled()
        self.push((tick + 1) * self.config.report_interval_s, REPORT, tick + 1)

    def _fold_cache_deltas(self) -> None:
        """Each engine's prefix-cache delta since the last tick, folded into the prefix index as
        the batch its agent publishes (a cleared cache: a full batch of what it holds after)."""
        block_size = self.config.profile.block_size
        for instance_id, instance in self.instances.items():
            delta = instance.engine.take_cache_delta()
            if not delta:
                continue
            seq = self._kv_batches.get(instance_id, 0) + 1
            self._kv_batches[instance_id] = seq
            full = delta.cleared or seq == 1
            batch = KVCacheEvents(
                instance_id=instance_id, incarnation=instance_id, seq=seq, block_size=block_size,
                stored=tuple(instance.engine.cached_block_hashes()) if delta.cleared else delta.stored,
                removed=() if full else delta.removed, full=full,
            )
            self.prefix.apply(batch)

    def _on_pair(self, tick: int) -> None:
        self.layer.pair()
        self.migrations.start_all()
        self.push((tick + 1) * self.config.pairing_interval_s, PAIR, tick + 1)

    def _on_scale(self, tick: int) -> None:
        decision = self.layer.scale(self.now)
        if isinstance(decision, ScaleUpDecision):
            for _ in range(decision.num_instances):
                instance_id = self._new_instance_id()
                self._launching[instance_id] = self.now
                self.push(self.now + self.config.startup_delay_s, READY, instance_id)
        elif isinstance(decision, ScaleDownDecision):
            instance = self.instances.get(decision.instance_id)
            if instance is not None:
                instance.terminating = True
                instance.dirty = True
                self.leave_if_drained(instance.instance_id)
        self.push((tick + 1) * self.config.scaling_interval_s, SCALE, tick + 1)

    def _on_ready(self, instance_id: str) -> None:
        launched = self._launching.pop(instance_id)
        instance = self._join(instance_id, launched)
        self.layer.fold((instance.joined,))
        self._retry_unplaced()

    def _on_sample(self, tick: int | None, *, reschedule: bool = True) -> None:
        free: list[int] = []
        blocked: list[int] = []
        total = 0
        for instance in self.instances.values():
            num_free = instance.num_free_blocks
            demand = instance.head_of_line_demand(instance.snapshot())
            free.append(num_free)
            blocked.append(demand if demand > num_free else 0)
            total += instance.num_total_blocks
        self.fragmentation_series.append((self.now, fragmentation_share(free, blocked, total)))
        for instance_id, instance in self.instances.items():
            self.running_samples[instance_id] = (
                self.running_samples.get(instance_id, 0) + instance.engine.scheduler.num_running
            )
        self.instances_series.append((self.now, len(self.instances) + len(self._launching)))
        if self.on_progress is not None:
            self.on_progress(self.num_done, len(self.workload.requests), self.now)
        if reschedule and tick is not None:
            self.push((tick + 1) * self.config.sample_interval_s, SAMPLE, tick + 1)


def simulate(
    config: SimConfig, workload: Workload, *, on_progress: ProgressCallback | None = None
) -> SimResult:
    """Run one simulation and return its summary."""
    return Simulator(config, workload, on_progress=on_progress).run()
