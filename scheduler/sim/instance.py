"""One simulated instance: a ``sim`` engine and the agent-side bookkeeping around it.

:class:`SimInstance` owns a :class:`~agents.engines.sim.SimEngine` (the local
scheduler with preemption, the block manager, the timing model) and does what
an agent does for the scheduler: it knows which requests live on it, counts
the requests it accepted, and builds :class:`~schemas.LoadReport` s whose
freeness comes from the shared virtual-usage functions. It reports only when
something changed since its last report (``dirty``), as an agent that reports
on change at an interval would.

The instance also tracks the step in flight (planned with
:meth:`SimEngine.begin_step`, completed at its end time) and counts its
migrations in and out; it implements
:class:`~scheduler.sim.migration_ports.MigrationInstance`, which is all the
migration code knows of it. The event loop lives in :mod:`scheduler.sim.simulator`.
"""

from __future__ import annotations

from collections.abc import Collection

from agents.engines.local_scheduler import Request, SchedulerOutput
from agents.engines.protocol import RequestStatus
from agents.engines.sim import SimEngine
from agents.migration.fsm.config import short_of_memory
from scheduler.config import PolicyConfig
from scheduler.policy import RunningRequest, freeness, virtual_usage_of_groups
from scheduler.policy.growth import OutputLengthEstimate, expected_growth_blocks
from scheduler.sim.migration_ports import Continuation
from schemas.block_hash import block_hashes
from schemas.instance import InstanceJoined
from schemas.load import LoadReport, PriorityLoad

__all__ = ["InstanceSnapshot", "SimInstance"]

_RUNNING = RequestStatus.RUNNING
_SUSPENDED = RequestStatus.SUSPENDED


class InstanceSnapshot:
    """Aggregates of one instance's requests (what a load report and request selection need)."""

    __slots__ = (
        "expected_growth_blocks",
        "head_of_line",
        "num_waiting",
        "prefill_blocks",
        "running",
        "waiting_demand",
    )

    def __init__(self) -> None:
        self.running: dict[int, list[int]] = {}  # priority -> [num_running, num_blocks]
        self.head_of_line: Request | None = None
        self.num_waiting = 0
        self.waiting_demand = 0
        self.expected_growth_blocks = 0
        self.prefill_blocks = 0


class SimInstance:
    """A sim engine plus what its agent knows. Mutated only by the simulator."""

    def __init__(self, instance_id: str, engine: SimEngine, *, launched_s: float, joined_s: float) -> None:
        self.instance_id = instance_id
        self.engine = engine
        info = engine.info
        self.joined = InstanceJoined(
            instance_id=instance_id,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            model=info.model,
            kv_layout=info.kv_layout,
            transport_address=f"sim://{instance_id}",
            engine="sim",
            max_batch_size=info.max_batch_size,
            max_model_len=info.max_model_len,
        )
        self.block_size = info.block_size
        self.bytes_per_block = info.bytes_per_block
        self.launched_s = launched_s
        self.joined_s = joined_s
        self.request_ids: dict[str, None] = {}  # requests that live here (insertion-ordered set)
        self.num_accepted = 0
        self.report_seq = 0
        self.terminating = False
        self.dirty = True
        self.plan: SchedulerOutput | None = None  # the step in flight
        self.plan_duration_s = 0.0
        self.num_migrating_out = 0
        self.num_migrating_in = 0
        #: the output length learned from the requests finished here (as an agent learns it)
        self.output_length = OutputLengthEstimate()
        #: request id -> (tokens hashed, chain) of waiting requests, computed once per length
        self._chains: dict[str, tuple[int, list[int]]] = {}

    @property
    def busy(self) -> bool:
        return self.plan is not None

    @property
    def num_total_blocks(self) -> int:
        return self.engine.info.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.engine.scheduler.blocks.num_free_blocks

    @property
    def num_reserved_blocks(self) -> int:
        return self.engine.scheduler.blocks.num_reserved_blocks

    def is_drained(self) -> bool:
        """No request, no migration and no step left: a terminating instance may leave."""
        return (
            not self.request_ids and self.plan is None
            and self.num_migrating_out == 0 and self.num_migrating_in == 0
        )

    def snapshot(self) -> InstanceSnapshot:
        """Aggregate the requests that live here (running and suspended ones hold blocks)."""
        snap = InstanceSnapshot()
        running = snap.running
        get = self.engine.scheduler.get
        block_size = self.block_size
        head: Request | None = None
        expected_output = self.output_length.expected_output_tokens
        growing: list[tuple[int, int, int]] = []
        for request_id in self.request_ids:
            request = get(request_id)
            if request is None:
                continue
            status = request.status
            if status is _RUNNING or status is _SUSPENDED:
                num_blocks = len(request.block_ids)
                entry = running.get(request.priority)
                if entry is None:
                    running[request.priority] = [1, num_blocks]
                else:
                    entry[0] += 1
                    entry[1] += num_blocks
                unprefilled = len(request.all_token_ids) - request.num_computed_tokens
                if unprefilled > 1:
                    snap.prefill_blocks += -(-unprefilled // block_size)
                if expected_output > 0:
                    growing.append((len(request.all_token_ids), request.num_prompt_tokens, num_blocks))
            else:
                snap.num_waiting += 1
                snap.waiting_demand += -(-len(request.all_token_ids) // block_size)
                key = (request.priority, request.arrival_seq)
                if head is None or key < (head.priority, head.arrival_seq):
                    head = request
        snap.head_of_line = head
        snap.expected_growth_blocks = expected_growth_blocks(growing, expected_output, block_size)
        return snap

    def waiting_cached_blocks(self) -> int | None:
        """The blocks of the waiting requests' tokens the prefix cache holds now (their leading
        cached runs), as the agent reports them; None with the prefix cache off."""
        scheduler = self.engine.scheduler
        if not scheduler.config.prefix_cache:
            return None
        lookup, get, block_size = scheduler.blocks.lookup, scheduler.get, self.block_size
        chains, kept = self._chains, {}
        total = 0
        for request_id in self.request_ids:
            request = get(request_id)
            if request is None or request.status is _RUNNING or request.status is _SUSPENDED:
                continue
            tokens = request.all_token_ids
            known = chains.get(request_id)
            if known is None or known[0] != len(tokens):
                known = (len(tokens), block_hashes(tokens, block_size))
            kept[request_id] = known
            total += len(lookup(known[1]))
        self._chains = kept
        return total

    def head_of_line_demand(self, snap: InstanceSnapshot) -> int:
        head = snap.head_of_line
        return 0 if head is None else -(-len(head.all_token_ids) // self.block_size)

    def current_head_of_line_demand(self) -> int:
        return self.head_of_line_demand(self.snapshot())

    def short_of_memory(self) -> bool:
        snap = self.snapshot()
        return short_of_memory(
            terminating=self.terminating, num_waiting=snap.num_waiting, num_free_blocks=self.num_free_blocks,
            expected_growth_blocks=snap.expected_growth_blocks,
        )

    def continuation(self, request_id: str) -> Continuation | None:
        """How to continue ``request_id`` elsewhere (what a ``Commit`` carries); None if it is not here."""
        request = self.engine.scheduler.get(request_id)
        if request is None or request_id not in self.request_ids:
            return None
        return Continuation(
            request.prompt_token_ids, request.output_token_ids, request.sampling, request.priority
        )

    def chain(self, request_id: str, num_full_blocks: int) -> tuple[int, ...]:
        """The block hashes of the request's first ``num_full_blocks`` blocks (prompt and output),
        what a migration's source offers so that the destination's cached run is not copied."""
        request = self.engine.scheduler.get(request_id)
        if request is None or num_full_blocks <= 0:
            return ()
        block_size = self.block_size
        tokens = (*request.prompt_token_ids, *request.output_token_ids)
        return tuple(block_hashes(tokens[: num_full_blocks * block_size], block_size))

    def adopt(self, request_id: str) -> None:
        self.request_ids[request_id] = None
        self.dirty = True

    def forget(self, request_id: str) -> None:
        self.request_ids.pop(request_id, None)
        self.dirty = True

    def build_report(self, config: PolicyConfig) -> LoadReport:
        """This instance's load report now; freeness from the shared virtual-usage functions."""
        snap = self.snapshot()
        groups = tuple(
            PriorityLoad(priority=p, num_running=n, num_blocks=b)
            for p, (n, b) in sorted(snap.running.items(), key=lambda item: item[0])
        )
        demand = self.head_of_line_demand(snap)
        reserved = self.num_reserved_blocks
        usage = virtual_usage_of_groups(
            groups, demand, config=config, terminating=self.terminating, num_reserved_blocks=reserved,
        )
        batch = sum(g.num_running for g in groups)
        self.report_seq += 1
        self.dirty = False
        head = snap.head_of_line
        cached = self.waiting_cached_blocks()
        return LoadReport(
            instance_id=self.instance_id,
            seq=self.report_seq,
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_reserved_blocks=reserved,
            running=groups,
            head_of_line_demand=demand,
            num_waiting=snap.num_waiting,
            batch_size=batch,
            freeness=freeness(self.num_total_blocks, usage, batch),
            virtual_usage=usage,
            num_accepted=self.num_accepted,
            head_of_line_priority=0 if head is None else head.priority,
            terminating=self.terminating,
            num_migrating_out=self.num_migrating_out,
            num_migrating_in=self.num_migrating_in,
            waiting_demand=snap.waiting_demand,
            expected_growth_blocks=snap.expected_growth_blocks,
            prefill_blocks=snap.prefill_blocks,
            waiting_uncached_blocks=-1 if cached is None else max(snap.waiting_demand - cached, 0),
        )

    def migration_candidates(self, migrating: Collection[str]) -> tuple[list[RunningRequest], list[str]]:
        """Running requests as request selection sees them, and those that may not move now.

        Excluded: requests already migrating, suspended ones, and those without a
        generated token yet (only decoding requests migrate).
        """
        get = self.engine.scheduler.get
        running: list[RunningRequest] = []
        exclude: list[str] = []
        for request_id in self.request_ids:
            request = get(request_id)
            if request is None or not request.status.holds_blocks:
                continue
            running.append(RunningRequest(
                priority=request.priority, num_blocks=len(request.block_ids),
                request_id=request_id, num_tokens=len(request.all_token_ids),
            ))
            if (
                request.status is not _RUNNING
                or request_id in migrating
                or request.num_computed_tokens < request.num_prompt_tokens
                or len(request.all_token_ids) <= request.num_prompt_tokens
            ):
                exclude.append(request_id)
        return running, exclude
