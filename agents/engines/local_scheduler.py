"""The local scheduler shared by shoal's own engines: queue, batch, preempt, stop.

Pure and synchronous; no tensors, no clock, no I/O. It owns every request's
state (:class:`Request`, status :class:`~agents.engines.protocol.RequestStatus`) and the
instance's :class:`~agents.engines.block_manager.BlockManager`.

How an engine uses this (vLLM v1 style)::

    sched = LocalScheduler(LocalSchedulerConfig(num_blocks=..., block_size=..., max_model_len=...,
                                           vocab_size=..., eos_token_id=...))
    sched.add_request(request_id, prompt_token_ids, sampling, priority)  # may raise RequestRejected

    def step(self) -> StepResult:                      # the engine's whole step
        out = sched.schedule()                         # SchedulerOutput: plain data
        sampled = self.execute(out)                    # {request_id: next token id}
        return StepResult(sched.update_from_output(out, sampled), ...)

``execute`` runs the model (or a timing model) over:

* ``out.prefills`` — :class:`ScheduledPrefill` ``(request, start, end, final)``: feed
  ``request.all_token_ids[start:end]`` at positions ``start..end-1``; a prefill that is
  not ``final`` is one chunk of a longer prompt (chunked prefill) and samples nothing;
* ``out.decodes`` — :class:`Request` s that feed one token,
  ``request.all_token_ids[-1]`` at position ``request.num_computed_tokens``;

writing KV into ``request.block_ids`` (position ``p`` lives in block
``block_ids[p // block_size]`` at slot ``p % block_size``; the blocks are
already allocated), and returns one sampled token per scheduled request (chunks that are not final need none).
``update_from_output`` appends the tokens, applies max_tokens / min_tokens /
stop_token_ids / EOS / context and capacity limits, frees finished requests'
blocks and returns :class:`~agents.engines.protocol.RequestOutput` s. Requests aborted or
released between ``schedule`` and ``update_from_output`` are skipped.

Policy: the queue is ordered by priority (lower value first, as in vLLM) then arrival (FCFS);
the head is admitted when its blocks fit and the batch is not full (no
admission in a step that had to preempt). Every step each running request
gets the block for its next token; if none is free, the newest request of the
lowest priority is preempted by recompute (blocks freed, queued again at its
original place), possibly the growing request itself.

Three experimental priority rules exist, off by default and offered by no command line (the
simulator found no gain from them for high-priority requests that did not cost normal ones
more; docs/policies.md): ``priority_preemption`` (a queue head that does
not fit preempts running requests of a worse priority, newest first, when that makes room; the
victims leave the step's plan and the head is admitted in the same step),
``prompts_by_priority`` (the prompts admitted in one step share the first one's priority) and
``high_priority_reserve_blocks`` (free blocks a request may take only if it has the best priority
the instance has seen, or if nothing else runs).

Chunked prefill (``max_step_tokens``): a step computes at most that many
tokens. Decodes take one each; running prompts that are part-way through their
prefill, then admitted ones, share the rest (at least ``block_size`` tokens, so
a full batch of decodes cannot starve them); a prompt longer than what is left
is computed in chunks over the next steps, alongside the decodes, so a long
prompt never holds the running batch up for more than one step's budget. A
request's blocks are allocated for its whole prompt when it is admitted.

A request with ``max_tokens`` 0 (a prompt scored for its logprobs, or echoed) finishes after its
prefill with no token (``length``); the token its last position sampled is dropped.

Prefix caching (``prefix_cache``, vLLM's automatic prefix caching): every full block whose
KV is computed, prompt or generated, enters the block manager's cache under its chained hash
(:mod:`schemas.block_hash`). A request admitted with no blocks here (new, rescued or
preempted) first takes the cached blocks of the longest cached prefix of its tokens, at most
all but its last token (so the step computes at least one position and samples from it), and
its prefill starts after them: ``num_cached_tokens`` on its outputs says how many tokens it
did not compute. A request that asks for prompt logprobs and has generated nothing takes no hit:
every position of its prompt is computed, as in vLLM. Cached blocks nobody uses count as free
and are evicted, least recently freed first, when a request needs the room.

Structured outputs: a request whose sampling has a ``structured`` constraint holds a
:class:`TokenConstraint` (built by the :class:`Constraints` the engine passes in, e.g.
:class:`agents.engines.grammar.GrammarCompiler`) from its admission on; the engine's sampler reads
it for the next token's mask. Each sampled token advances it once (a preemption by recompute
samples no token again, so nothing is fed twice); a request admitted with generated tokens
(migrated in, or rescued) gets one built from those tokens, so its state never travels. When the
grammar is complete the request finishes (``stop``), even under ``ignore_eos`` or before
``min_tokens``: nothing else may follow. A constraint that does not compile, or generated tokens
it refuses, is a rejection (``INVALID_SAMPLING``) naming the problem.

For migration the scheduler also reserves blocks, admits a migrated request
with a block table made of reservations, suspends/resumes and releases.
"""

from __future__ import annotations

import bisect
import heapq
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agents.engines.block_manager import BlockManager, CacheDelta, Reservation
from agents.engines.protocol import (
    FINISH_REASONS,
    EngineStats,
    InvalidRequestState,
    MigrationError,
    PreemptionEvent,
    RejectionEvent,
    RejectReason,
    RequestOutput,
    RequestRejected,
    RequestStats,
    RequestStatus,
    SchedulerEvent,
    UnknownRequest,
)
from schemas import Alternatives, SamplingParams, StructuredOutput
from schemas.block_hash import extend_block_hashes, root_hash

__all__ = [
    "Constraints",
    "LocalScheduler",
    "LocalSchedulerConfig",
    "Request",
    "RequestStatus",
    "ScheduledPrefill",
    "SchedulerOutput",
    "TokenConstraint",
]


class TokenConstraint(Protocol):
    """One request's position in its structured-output grammar."""

    def accept(self, token_id: int) -> bool:
        """Take the next generated token; False if the grammar refuses it."""
        ...

    def is_complete(self) -> bool:
        """Nothing but the end may follow (also after a refused token)."""
        ...


class Constraints(Protocol):
    """Builds requests' constraints over the engine's vocabulary."""

    def build(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> TokenConstraint:
        """A constraint at the position after ``generated``; ValueError naming the problem if
        ``structured`` does not compile or refuses one of ``generated``."""
        ...


@dataclass(frozen=True, slots=True)
class LocalSchedulerConfig:
    """Static limits of one instance."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    max_batch_size: int = 256
    #: Prompt tokens admitted per step; the first prefill of a step is always admitted.
    max_prefill_tokens: int | None = None
    #: Tokens computed per step (chunked prefill, see the module docstring); None: whole prompts.
    max_step_tokens: int | None = None
    #: Experimental, off by default. A queue head that does not fit preempts running requests of
    #: a worse priority (newest first, vLLM's priority preemption) when that makes room.
    priority_preemption: bool = False
    #: The prompts admitted in one step share one priority (a high-priority prompt is not
    #: prefilled alongside normal ones).
    prompts_by_priority: bool = False
    #: Free blocks a queued request may not take unless it has the best priority this instance
    #: has seen or nothing else runs (memory kept for high priority); no effect where every
    #: request has one priority.
    high_priority_reserve_blocks: int = 0
    #: Automatic prefix caching (see the module docstring).
    prefix_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_model_len", "vocab_size", "max_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_step_tokens is not None and self.max_step_tokens <= 0:
            raise ValueError(f"max_step_tokens must be positive, got {self.max_step_tokens}")
        if self.high_priority_reserve_blocks < 0:
            raise ValueError(
                f"high_priority_reserve_blocks must be >= 0, got {self.high_priority_reserve_blocks}"
            )

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_num_tokens(self) -> int:
        """A request finishes ("length") once its sequence reaches this many tokens."""
        # With N tokens the next decode needs KV for N tokens, so N may reach capacity + 1.
        return min(self.max_model_len, self.capacity_tokens + 1)


@dataclass(slots=True, eq=False)
class Request:
    """One request's state in this instance. Mutated only by :class:`LocalScheduler`."""

    request_id: str
    sampling: SamplingParams
    priority: int
    arrival_seq: int
    num_prompt_tokens: int
    all_token_ids: list[int]  # prompt, then generated tokens
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in block_ids
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    #: prompt tokens found in the prefix cache at its first admission here (not computed)
    num_cached_tokens: int = 0
    #: the chain hashes of its full blocks computed so far (prefix caching)
    block_hashes: list[int] = field(default_factory=list)
    #: how many of ``block_ids`` are registered in the prefix cache (a prefix of them)
    num_registered_blocks: int = 0
    #: whether it was ever admitted here (its cached tokens are reported from the first time)
    admitted: bool = False
    #: its structured-output state (``sampling.structured``), at the position after its tokens
    constraint: TokenConstraint | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return tuple(self.all_token_ids[: self.num_prompt_tokens])

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.all_token_ids[self.num_prompt_tokens :])


@dataclass(frozen=True, slots=True)
class ScheduledPrefill:
    """Compute KV for ``request.all_token_ids[start:end]``; if ``final``, sample the next token.

    ``final`` is False for a chunk of a prompt that continues in a later step.
    """

    request: Request
    start: int
    end: int
    final: bool = True

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Block tables are ``request.block_ids`` (allocated already)."""

    step_id: int
    prefills: list[ScheduledPrefill]
    decodes: list[Request]
    preempted: list[str]
    num_prefill_tokens: int
    #: Sum over decodes of the KV tokens each attends to (its sequence length).
    num_decode_context_tokens: int

    @property
    def num_scheduled(self) -> int:
        return len(self.prefills) + len(self.decodes)


_RUNNING = RequestStatus.RUNNING
_SUSPENDED = RequestStatus.SUSPENDED


def _order_key(request: Request) -> tuple[int, int]:
    """Priority (lower value first, as in vLLM), then arrival (older first): the queue's and
    the batch's order."""
    return (request.priority, request.arrival_seq)


class LocalScheduler:
    """Admission, continuous batching, preemption and stop logic of one instance."""

    def __init__(self, config: LocalSchedulerConfig, *, constraints: Constraints | None = None) -> None:
        """``constraints``: what builds the structured-output state of a request that asks for one;
        None: such requests are refused."""
        self.config = config
        self._constraints = constraints
        self.blocks = BlockManager(config.num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        self._prefix_cache = config.prefix_cache
        self._root_hash = root_hash(config.block_size)
        self.prefix_cache_queries = 0  # tokens looked up at admission (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # of those, tokens found cached (prefix_cache_hits)
        self._max_num_tokens = config.max_num_tokens
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []  # RUNNING and SUSPENDED, sorted by _order_key
        self._waiting: list[tuple[int, int, Request]] = []  # heap; stale entries skipped lazily
        self._num_waiting = 0
        self._num_suspended = 0
        self._next_arrival = 0
        self._best_priority = sys.maxsize  # the best (lowest) priority ever queued here
        self._step_id = 0
        self._events: list[SchedulerEvent] = []
        self.num_preemptions = 0
        self.num_rejections = 0
        self.num_finished = 0
        #: sampled tokens a request's grammar refused (a sampler that ignored the mask): it finished
        self.num_constraint_refusals = 0

    # ------------------------------------------------------------ queries

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def request(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(request_id)
        return request

    @property
    def num_running(self) -> int:
        return len(self._running) - self._num_suspended

    @property
    def num_suspended(self) -> int:
        return self._num_suspended

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def take_events(self) -> list[SchedulerEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------ adding

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        """Queue a request; False if the id is already here. Raises :class:`RequestRejected`."""
        if request_id in self._requests:
            return False
        constraint = self._validate(request_id, prompt_token_ids, output_token_ids, sampling)
        request = self._new_request(request_id, prompt_token_ids, output_token_ids, sampling, priority)
        request.constraint = constraint
        self._enqueue(request)
        return True

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
    ) -> Request:
        tokens = list(prompt_token_ids)
        tokens.extend(output_token_ids)
        request = Request(
            request_id=request_id,
            sampling=sampling,
            priority=priority,
            arrival_seq=self._next_arrival,
            num_prompt_tokens=len(prompt_token_ids),
            all_token_ids=tokens,
        )
        self._next_arrival += 1
        self._requests[request_id] = request
        return request

    def _validate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
    ) -> TokenConstraint | None:
        """RequestRejected if the request cannot run here; its constraint (built from
        ``output_token_ids``) if its sampling has one."""
        config = self.config
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        problem: tuple[RejectReason, str] | None = None
        if not prompt_token_ids:
            problem = (RejectReason.EMPTY_PROMPT, "the prompt has no tokens")
        elif sampling.max_tokens < 0:
            problem = (RejectReason.INVALID_SAMPLING, f"max_tokens must be >= 0, got {sampling.max_tokens}")
        elif sampling.min_tokens < 0:
            problem = (RejectReason.INVALID_SAMPLING, f"min_tokens must be >= 0, got {sampling.min_tokens}")
        elif len(output_token_ids) >= max(sampling.max_tokens, 1):
            problem = (
                RejectReason.INVALID_SAMPLING,
                f"{len(output_token_ids)} tokens already generated, max_tokens is {sampling.max_tokens}",
            )
        elif num_tokens > config.max_model_len:
            problem = (
                RejectReason.EXCEEDS_MODEL_CONTEXT,
                f"{num_tokens} tokens exceed the model's context of {config.max_model_len}",
            )
        elif num_tokens > config.capacity_tokens:
            problem = (
                RejectReason.EXCEEDS_CAPACITY,
                f"{num_tokens} tokens need {self.blocks.blocks_for_tokens(num_tokens)} blocks, "
                f"the instance has {config.num_blocks} ({config.capacity_tokens} tokens)",
            )
        else:
            vocab = config.vocab_size
            for token_ids in (prompt_token_ids, output_token_ids):
                if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
                    bad = next(t for t in token_ids if not 0 <= t < vocab)
                    problem = (RejectReason.TOKEN_OUT_OF_RANGE, f"token id {bad} is outside 0..{vocab - 1}")
                    break
            else:
                bad_bias = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab), None)
                if bad_bias is not None:
                    problem = (
                        RejectReason.INVALID_SAMPLING,
                        f"logit_bias token id {bad_bias} is outside 0..{vocab - 1}",
                    )
        constraint: TokenConstraint | None = None
        if problem is None and sampling.structured is not None:
            if self._constraints is None:
                problem = (RejectReason.INVALID_SAMPLING, "this engine does not enforce structured outputs")
            else:
                try:
                    constraint = self._constraints.build(sampling.structured, output_token_ids)
                except ValueError as exc:
                    problem = (RejectReason.INVALID_SAMPLING, str(exc))
        if problem is not None:
            reason, detail = problem
            self.num_rejections += 1
            self._events.append(RejectionEvent(request_id, reason, detail))
            raise RequestRejected(request_id, reason, detail)
        return constraint

    def _enqueue(self, request: Request) -> None:
        if request.priority < self._best_priority:
            self._best_priority = request.priority
        heapq.heappush(self._waiting, (request.priority, request.arrival_seq, request))
        self._num_waiting += 1

    def waiting_requests(self) -> list[Request]:
        """The queued requests in the order they would be admitted (priority, then arrival)."""
        requests = self._requests
        live = {
            id(request): (priority, seq, request)
            for priority, seq, request in self._waiting
            if request.status.is_queued and requests.get(request.request_id) is request
        }  # a request queued again after a preemption may have a stale twin in the heap
        return [entry[2] for entry in sorted(live.values(), key=lambda entry: (entry[0], entry[1]))]

    def _head(self) -> Request | None:
        """The head of the queue, dropping stale heap entries on the way."""
        waiting = self._waiting
        requests = self._requests
        while waiting:
            request = waiting[0][2]
            if request.status.is_queued and requests.get(request.request_id) is request:
                return request
            heapq.heappop(waiting)
        return None

    # ---------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Plan one step: grow running requests (preempting if needed), then admit from the queue."""
        self._step_id += 1
        blocks = self.blocks
        block_size = blocks.block_size
        running = self._running
        prefills: list[ScheduledPrefill] = []
        decodes: list[Request] = []
        preempted: list[str] = []
        partial: list[Request] = []  # running, with prompt tokens still to compute
        num_prefill_tokens = 0
        num_context_tokens = 0

        i = 0
        while i < len(running):
            request = running[i]
            if request.status is _SUSPENDED:
                i += 1
                continue
            num_tokens = len(request.all_token_ids)
            need = -(-num_tokens // block_size) - len(request.block_ids)
            if need > 0:
                while need > blocks.num_free_blocks:
                    victim = self._preempt_newest_lowest(preempted)
                    if victim is request:
                        break
                if request.status is not _RUNNING:
                    continue  # it preempted itself; running[i] is now whatever followed it
                request.block_ids.extend(blocks.allocate(need))
            if num_tokens - request.num_computed_tokens == 1:
                decodes.append(request)
                num_context_tokens += num_tokens
            else:
                partial.append(request)
            i += 1

        budget = self._prefill_budget(len(decodes))
        for request in partial:
            chunk = self._chunk(request, budget)
            if chunk is None:
                continue  # its prompt continues in a later step
            prefills.append(chunk)
            num_prefill_tokens += chunk.num_tokens
            if budget is not None:
                budget -= chunk.num_tokens

        if not preempted:
            if self.config.priority_preemption:
                freed = self._preempt_for_priority(decodes, prefills, preempted)
                if freed is not None:  # the preempted requests' work left this step
                    num_context_tokens -= freed
                    num_prefill_tokens = sum(chunk.num_tokens for chunk in prefills)
                    budget = self._prefill_budget(len(decodes))
                    if budget is not None:
                        budget -= num_prefill_tokens
            num_prefill_tokens += self._admit(prefills, num_prefill_tokens, budget)

        return SchedulerOutput(
            step_id=self._step_id,
            prefills=prefills,
            decodes=decodes,
            preempted=preempted,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_context_tokens=num_context_tokens,
        )

    def _prefill_budget(self, num_decodes: int) -> int | None:
        """Prompt tokens this step may compute after ``num_decodes`` decodes; None: no limit."""
        limit = self.config.max_step_tokens
        if limit is None:
            return None
        return max(limit - num_decodes, self.config.block_size)

    @staticmethod
    def _chunk(request: Request, budget: int | None) -> ScheduledPrefill | None:
        """The next piece of ``request``'s prefill within ``budget`` tokens, or None if none is left."""
        start = request.num_computed_tokens
        num_tokens = len(request.all_token_ids)
        if budget is None or num_tokens - start <= budget:
            return ScheduledPrefill(request, start, num_tokens)
        if budget <= 0:
            return None
        return ScheduledPrefill(request, start, start + budget, final=False)

    def _preempt_for_priority(
        self, decodes: list[Request], prefills: list[ScheduledPrefill], preempted: list[str]
    ) -> int | None:
        """Make room for a queue head that does not fit by preempting running requests of a worse
        priority, newest first (vLLM's priority preemption); only when their blocks do make room.

        The victims leave this step's plan (``decodes``, ``prefills``): returns the decode context
        tokens taken out of it, or None if nothing was preempted.
        """
        head = self._head()
        if head is None:
            return None
        blocks = self.blocks
        need = blocks.blocks_for_tokens(head.num_tokens) - len(head.block_ids)
        if need <= blocks.num_free_blocks and self.num_running < self.config.max_batch_size:
            return None
        worse = [r for r in self._running if r.status is _RUNNING and r.priority > head.priority]
        slots = self.num_running - self.config.max_batch_size + 1  # batch places to free for the head
        if (
            not worse
            or blocks.num_free_blocks + sum(len(r.block_ids) for r in worse) < need
            or len(worse) < slots
        ):
            return None  # preempting the worse ones would not let it in: it waits, as before
        context = 0
        while need > blocks.num_free_blocks or self.num_running >= self.config.max_batch_size:
            victim = self._preempt_newest_lowest(preempted)  # the batch's last: a worse priority
            if victim in decodes:
                decodes.remove(victim)
                context += victim.num_tokens
            prefills[:] = [chunk for chunk in prefills if chunk.request is not victim]
        return context

    def _admit(self, prefills: list[ScheduledPrefill], budget_used: int, budget: int | None) -> int:
        """Admit queue heads while they fit (and ``budget`` lasts); returns the prompt tokens scheduled.

        With ``prompts_by_priority`` the prompts admitted in one step share the first one's
        priority: a high-priority prompt is not prefilled alongside normal ones."""
        config = self.config
        blocks = self.blocks
        limit = config.max_prefill_tokens
        admitted_tokens = 0
        step_priority: int | None = None
        while self.num_running < config.max_batch_size:
            if budget is not None and budget - admitted_tokens <= 0:
                break
            head = self._head()
            if head is None:
                break
            if config.prompts_by_priority:
                if step_priority is None:
                    step_priority = head.priority
                elif head.priority != step_priority:
                    break
            hit = self._cached_prefix(head) if self._prefix_cache and not head.block_ids else []
            if hit and head.sampling.prompt_logprobs is not None and not head.num_output_tokens:
                hit = []  # prompt logprobs: every position is computed (as in vLLM)
            num_new = head.num_tokens - head.num_computed_tokens - len(hit) * blocks.block_size
            if limit is not None and prefills and budget_used + admitted_tokens + num_new > limit:
                break
            need = blocks.blocks_for_tokens(head.num_tokens) - len(head.block_ids) - len(hit)
            if head.priority > self._best_priority and self._running:
                need += config.high_priority_reserve_blocks  # kept unless the batch is empty
            if need + (blocks.num_evictable_among(hit) if hit else 0) > blocks.num_free_blocks:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            if self._prefix_cache and not head.block_ids:
                self._take_cached_prefix(head, hit)
            head.block_ids.extend(blocks.allocate(need))
            head.admitted = True
            head.status = RequestStatus.RUNNING
            bisect.insort(self._running, head, key=_order_key)
            chunk = self._chunk(head, None if budget is None else budget - admitted_tokens)
            assert chunk is not None  # the budget left is positive
            prefills.append(chunk)
            admitted_tokens += chunk.num_tokens
        return admitted_tokens

    # -------------------------------------------------------- prefix cache

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix, at most all but its last token."""
        block_size = self.config.block_size
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, self._root_hash)
        return self.blocks.lookup(hashes[: (len(request.all_token_ids) - 1) // block_size])

    def _take_cached_prefix(self, request: Request, hit: list[int]) -> None:
        """Start ``request``'s block table with the cached blocks ``hit`` (one reference each)."""
        num_cached = len(hit) * self.config.block_size
        self.prefix_cache_queries += len(request.all_token_ids)
        self.prefix_cache_hits += num_cached
        if not request.admitted:
            request.num_cached_tokens = num_cached
        if hit:
            self.blocks.share(hit)
            request.block_ids.extend(hit)
        request.num_computed_tokens = num_cached
        request.num_registered_blocks = len(hit)

    def _register(self, request: Request) -> None:
        """Enter ``request``'s newly completed full blocks into the prefix cache."""
        block_size = self.config.block_size
        num_full = min(request.num_computed_tokens // block_size, len(request.block_ids))
        if num_full <= request.num_registered_blocks:
            return
        hashes = extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, self._root_hash)
        blocks = self.blocks
        block_ids = request.block_ids
        for index in range(request.num_registered_blocks, num_full):
            blocks.cache_block(block_ids[index], hashes[index])
        request.num_registered_blocks = num_full

    def take_cache_delta(self) -> CacheDelta:
        """What the prefix cache gained and lost since the last call (for cache events)."""
        return self.blocks.take_cache_delta()

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds (for a full re-sync)."""
        return self.blocks.cached_hashes()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash and zero the cache's counters; running requests keep their blocks
        (their full blocks are not registered again)."""
        self.blocks.clear_cache()
        self.blocks.take_cache_delta()
        self.blocks.num_evictions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def _preempt_newest_lowest(self, preempted: list[str]) -> Request:
        """Preempt the last RUNNING request in batch order (lowest priority, newest)."""
        running = self._running
        for j in range(len(running) - 1, -1, -1):
            victim = running[j]
            if victim.status is RequestStatus.RUNNING:
                del running[j]
                num_freed = len(victim.block_ids)
                self.blocks.free(victim.block_ids)
                victim.block_ids = []
                victim.num_computed_tokens = 0
                victim.num_registered_blocks = 0
                victim.num_preemptions += 1
                victim.status = RequestStatus.PREEMPTED
                self._enqueue(victim)
                self.num_preemptions += 1
                preempted.append(victim.request_id)
                self._events.append(PreemptionEvent(victim.request_id, self._step_id, num_freed))
                return victim
        raise AssertionError("preemption with no running request")  # the caller is running

    # ------------------------------------------------------------ updating

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        logprobs: Mapping[str, float] | None = None,
        top_logprobs: Mapping[str, Alternatives] | None = None,
    ) -> list[RequestOutput]:
        """Append one sampled token per scheduled request, apply stop rules, free finished ones.

        This is the per-token hot path of the simulator, hence the local variables.
        """
        results: list[RequestOutput] = []
        requests = self._requests
        max_num_tokens = self._max_num_tokens
        eos = self.config.eos_token_id
        cache = self._prefix_cache
        block_size = self.config.block_size
        any_finished = False
        scheduled: list[tuple[Request, int]] = []
        for prefill in output.prefills:
            if prefill.final:
                scheduled.append((prefill.request, prefill.end))
            elif self._is_live(prefill.request):
                prefill.request.num_computed_tokens = prefill.end  # a chunk: no token yet
                if cache:
                    self._register(prefill.request)
        scheduled += [(r, r.num_computed_tokens + 1) for r in output.decodes]
        for request, num_computed in scheduled:
            request_id = request.request_id
            status = request.status
            if status is not _RUNNING and status is not _SUSPENDED:
                continue  # aborted or released while the step ran
            if requests.get(request_id) is not request:
                continue  # ... and its id re-used meanwhile
            try:
                token_id = sampled[request_id]
            except KeyError:
                raise ValueError(f"no sampled token for scheduled request {request_id!r}") from None
            request.num_computed_tokens = num_computed
            if not request.sampling.max_tokens:  # the prompt only (its logprobs, echo): no token
                if cache:
                    self._register(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                any_finished = True
                results.append(RequestOutput(
                    request_id, 0, (), FINISH_REASONS[RequestStatus.FINISHED_LENGTH],
                    request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
                ))
                continue
            tokens = request.all_token_ids
            tokens.append(token_id)
            if cache and num_computed // block_size > request.num_registered_blocks:
                self._register(request)  # before a finish frees its blocks
            num_output = len(tokens) - request.num_prompt_tokens
            sampling = request.sampling
            finish: RequestStatus | None = None
            if num_output >= sampling.max_tokens or len(tokens) >= max_num_tokens:
                finish = RequestStatus.FINISHED_LENGTH
            elif num_output >= sampling.min_tokens and (
                (token_id == eos and not sampling.ignore_eos) or token_id in sampling.stop_token_ids
            ):
                finish = RequestStatus.FINISHED_STOPPED
            elif request.constraint is not None and self._constrained_end(request.constraint, token_id):
                finish = RequestStatus.FINISHED_STOPPED
            reason = None
            if finish is not None:
                self._finish(request, finish)
                reason = FINISH_REASONS[finish]
                any_finished = True
            logprob = None if logprobs is None else logprobs.get(request_id)
            top = None if top_logprobs is None else top_logprobs.get(request_id)
            results.append(
                RequestOutput(request_id, num_output - 1, (token_id,), reason, request.num_prompt_tokens,
                              None if logprob is None else (logprob,), None if top is None else (top,),
                              request.num_cached_tokens)
            )
        if any_finished:
            self._running = [r for r in self._running if not r.status.is_finished]
        return results

    def _constrained_end(self, constraint: TokenConstraint, token_id: int) -> bool:
        """Advance ``constraint`` by the sampled token; True if the request must finish there (its
        grammar is complete, or it refused the token)."""
        if not constraint.accept(token_id):
            self.num_constraint_refusals += 1
            return True
        return constraint.is_complete()

    def _is_live(self, request: Request) -> bool:
        """Still holds its blocks here and its id still names it (not aborted or released meanwhile)."""
        status = request.status
        return (status is _RUNNING or status is _SUSPENDED) and self._requests.get(
            request.request_id
        ) is request

    def _finish(self, request: Request, status: RequestStatus, *, finished_here: bool = True) -> None:
        """Terminal transition: free blocks, forget the request (callers drop it from the running list)."""
        if request.status.holds_blocks:
            self.blocks.free(request.block_ids)
            request.block_ids = []
            if request.status is RequestStatus.SUSPENDED:
                self._num_suspended -= 1
        elif request.status.is_queued:
            self._num_waiting -= 1  # its heap entry goes stale
        request.status = status
        del self._requests[request.request_id]
        if finished_here:
            self.num_finished += 1

    # ---------------------------------------------------------- lifecycle

    def abort(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        held = request.status.holds_blocks
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        if held:
            self._running.remove(request)
        return True

    def release_request(self, request_id: str) -> int:
        """Forget a request that migrated away; free its blocks (no output). Returns blocks freed."""
        request = self.request(request_id)
        num_blocks = len(request.block_ids)
        held = request.status.holds_blocks
        self._finish(request, RequestStatus.FINISHED_ABORTED, finished_here=False)  # it lives on elsewhere
        if held:
            self._running.remove(request)
        return num_blocks

    def suspend(self, request_id: str) -> None:
        """Leave a running request out of the batch, keeping its blocks; or hold a request that is
        still queued and never ran here (WAITING, no KV) out of the queue, for a move without KV.
        A held request is SUSPENDED with no blocks; :meth:`resume` queues it again in its place."""
        request = self.request(request_id)
        if request.status is RequestStatus.SUSPENDED:
            return
        if request.status is RequestStatus.WAITING and not request.block_ids:
            self._num_waiting -= 1  # its heap entry goes stale
            bisect.insort(self._running, request, key=_order_key)
        elif request.status is not RequestStatus.RUNNING:
            raise InvalidRequestState(f"cannot suspend {request_id!r}: it is {request.status.name}")
        request.status = RequestStatus.SUSPENDED
        self._num_suspended += 1

    def resume(self, request_id: str) -> None:
        """Put a suspended request back into the batch (a held queued one back into the queue)."""
        request = self.request(request_id)
        if request.status is RequestStatus.RUNNING:
            return
        if request.status is not RequestStatus.SUSPENDED:
            raise InvalidRequestState(f"cannot resume {request_id!r}: it is {request.status.name}")
        self._num_suspended -= 1
        if not request.block_ids:  # held while queued: back to its place (priority, arrival)
            self._running.remove(request)
            request.status = RequestStatus.WAITING
            self._enqueue(request)
            return
        request.status = RequestStatus.RUNNING

    # ---------------------------------------------------------- migration

    def reserve(self, num_blocks: int) -> Reservation:
        return self.blocks.reserve(num_blocks)

    def release_reservation(self, reservation_id: int) -> int:
        return self.blocks.release(reservation_id)

    def admit_migrated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
        reservation_ids: Sequence[int],
        *,
        num_computed_tokens: int | None = None,
        cached_block_ids: Sequence[int] = (),
    ) -> Request:
        """Add a migrated request to the batch; its block table is ``cached_block_ids`` (its
        leading blocks, found in this instance's prefix cache and referenced for it by the
        migration: the references become the request's), then the reservations' blocks in order.
        Each cached block must hold the hash of the request's block at its place."""
        if request_id in self._requests:
            raise MigrationError(f"request {request_id!r} is already on this instance")
        if not output_token_ids:
            raise MigrationError(f"request {request_id!r} has no generated token; only running ones migrate")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        computed = num_tokens - 1 if num_computed_tokens is None else num_computed_tokens
        if not 0 <= computed < num_tokens:
            raise MigrationError(f"num_computed_tokens {computed} outside 0..{num_tokens - 1}")
        reservations = [self.blocks.reservation(rid) for rid in reservation_ids]  # raises if unknown
        cached = list(cached_block_ids)
        if cached:
            self._check_cached_prefix(request_id, [*prompt_token_ids, *output_token_ids], cached)
        num_blocks = len(cached) + sum(r.num_blocks for r in reservations)
        if num_blocks < self.blocks.blocks_for_tokens(computed):
            raise MigrationError(
                f"{num_blocks} blocks cannot hold the KV of {computed} tokens "
                f"(block size {self.blocks.block_size})"
            )
        constraint = self._validate(request_id, prompt_token_ids, output_token_ids, sampling)
        request = self._new_request(request_id, prompt_token_ids, output_token_ids, sampling, priority)
        request.constraint = constraint
        request.block_ids.extend(cached)
        for reservation in reservations:
            request.block_ids.extend(self.blocks.commit(reservation.reservation_id))
        request.num_computed_tokens = computed
        request.admitted = True
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=_order_key)
        if self._prefix_cache:
            self._register(request)  # imported full blocks enter this instance's cache
        return request

    def _check_cached_prefix(self, request_id: str, token_ids: list[int], block_ids: list[int]) -> None:
        """MigrationError unless each block is held and cached under the chain hash of the
        request's block at its place (the KV there is the request's own)."""
        blocks = self.blocks
        hashes = extend_block_hashes([], token_ids[: len(block_ids) * blocks.block_size],
                                     blocks.block_size, self._root_hash)
        if len(hashes) < len(block_ids):
            raise MigrationError(f"{len(block_ids)} cached blocks for the {len(hashes)} full blocks "
                                 f"of request {request_id!r}")
        for index, (block_id, block_hash) in enumerate(zip(block_ids, hashes, strict=False)):
            if blocks.ref_count(block_id) <= 0 or blocks.block_hash(block_id) != block_hash:
                raise MigrationError(
                    f"block {index} of request {request_id!r} (local block {block_id}) is not a held "
                    "cached block of its prefix"
                )

    # --------------------------------------------------------------- stats

    def request_stats(self, request: Request) -> RequestStats:
        return RequestStats(
            request_id=request.request_id,
            status=request.status,
            priority=request.priority,
            num_blocks=len(request.block_ids),
            num_tokens=request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_preemptions=request.num_preemptions,
            arrival_seq=request.arrival_seq,
        )

    def stats(self) -> EngineStats:
        """Load snapshot; O(requests), meant for periodic load reports."""
        blocks = self.blocks
        head = self._head()
        waiting = sorted(
            (entry[2] for entry in self._waiting if entry[2].status.is_queued
             and self._requests.get(entry[2].request_id) is entry[2]),
            key=_order_key,
        )
        return EngineStats(
            num_total_blocks=blocks.num_total_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_reserved_blocks=blocks.num_reserved_blocks,
            num_running=self.num_running,
            num_suspended=self._num_suspended,
            num_waiting=self._num_waiting,
            head_of_line_demand=0 if head is None else blocks.blocks_for_tokens(head.num_tokens),
            head_of_line_priority=0 if head is None else head.priority,
            num_preemptions=self.num_preemptions,
            num_rejections=self.num_rejections,
            num_finished=self.num_finished,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_evictions=blocks.num_evictions,
            num_cached_blocks=blocks.num_cached_blocks,
            waiting_cached_blocks=self.waiting_cached_blocks(waiting),
            requests=tuple(self.request_stats(r) for r in [*self._running, *waiting]),
        )

    def waiting_cached_blocks(self, waiting: list[Request]) -> int:
        """How many blocks of the ``waiting`` requests' prompts the prefix cache holds now (the longest
        cached prefix of each that holds no blocks; a request's chain is hashed once and kept)."""
        if not self._prefix_cache:
            return 0
        return sum(len(self._cached_prefix(request)) for request in waiting if not request.block_ids)
