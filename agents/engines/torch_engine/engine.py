"""``TorchEngine``: the :class:`~agents.engines.protocol.Engine` over the plain-torch model and paged KV pool.

The step is the vLLM-v1 loop: the shared :class:`~agents.engines.local_scheduler.LocalScheduler`
plans (admission, batching, preemption, block tables), ``ModelRunner`` computes
next-token logits through the block tables, ``sampling.sample`` picks tokens,
and the scheduler applies the stop rules. Migration moves whole blocks: one
gather into a contiguous buffer (format v1, see :mod:`.kv_cache`) on export, one
scatter on import.

Prefix caching (``TorchEngineConfig.prefix_cache``, on by default) is the scheduler's: a
request admitted on cached blocks starts its prefill at ``num_computed_tokens`` (a block
boundary), so the step computes and writes KV only for the positions after its cached prefix,
into blocks of its own, and attends to the shared blocks through its block table as a later
chunk of a chunked prefill does. A cached block is full and complete, and no request writes
it again; ``shoal agent --no-prefix-cache`` turns the cache off.

Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's): every prefill chunk of a request
that asks, until it has generated a token, also scores its positions (the runner's
:class:`~.runner.PromptScoring`: the log-softmax over the vocabulary of the raw logits, the next
prompt token's logprob and the ``k`` most likely tokens); the engine files them by position and
puts them on the request's first output. The scheduler admits such a request without prefix-cache
hits, so every position is computed. A rescued request that has already delivered tokens computes
none (they went out with its first token).

``step_async`` computes in a worker thread so the agent's event loop keeps
serving (migration, new requests) meanwhile. Aborts and releases that arrive
while a step computes are applied when it completes (their blocks could
otherwise be handed to an incoming migration while the step still writes
them); the aborted requests' outputs of that step are dropped. A caller whose
loop has nothing else to do (``exclusive=True``) gets short steps computed on
its own thread instead: the forward pass is Python-heavy on CPU, so a thread
buys no parallelism there, only GIL hand-offs and interference between steps (``shoal bench
serve`` shows the difference in the gap between two decode steps).

With ``core="process"`` the model and its step live in a child process
(:mod:`.core`) and every step computes there, the caller's loop free meanwhile;
scheduling, block tables and migration stay here, on a KV pool both map.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from agents.engines.block_manager import Reservation
from agents.engines.grammar import GrammarCompiler
from agents.engines.local_scheduler import LocalScheduler, LocalSchedulerConfig, Request, SchedulerOutput
from agents.engines.protocol import (
    EngineInfo,
    EngineStats,
    KVBuffer,
    MigrationError,
    RejectionEvent,
    RejectReason,
    RequestOutput,
    RequestRejected,
    SchedulerEvent,
    StepResult,
    expected_step_s,
)
from agents.engines.scheduled import ScheduledEngine
from agents.engines.torch_engine.config import ModelConfig
from agents.engines.torch_engine.core import Computed, CoreProcess, LoadedSpec, ModelCore, StepWork
from agents.engines.torch_engine.kv_cache import (
    KVPoolShape,
    PagedKVPool,
    buffer_from_bytes,
    buffer_to_bytes,
    dtype_name,
)
from agents.engines.torch_engine.loader import load_model
from agents.engines.torch_engine.model import LlamaForCausalLM
from agents.engines.torch_engine.runner import ModelRunner, PromptScores, PromptScoring, SequenceWork
from agents.engines.torch_engine.sampling import (
    SamplingRow,
    check_sampling_params,
    request_seed,
    wants_history,
    with_grammar_masks,
)
from schemas import Alternatives, KVLayout, ModelIdentity, SamplingParams

__all__ = ["DEFAULT_KV_CACHE_BYTES", "TorchEngine", "TorchEngineConfig"]

#: A step's sampled token per request, and the logprobs and alternatives of those whose sampling asks
#: (None: none asks); then the prompt scores per request id with the prompt position of its first
#: scored token.
_Sampled = tuple[
    dict[str, int],
    dict[str, float] | None,
    dict[str, Alternatives] | None,
    dict[str, tuple[int, PromptScores]],
]
_NOTHING: _Sampled = ({}, None, None, {})

DEFAULT_KV_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    """Everything a torch engine instance is built from.

    ``model`` is a preset name (``tiny``, ``small``, ``kv-heavy``; weights drawn
    from ``seed``) or a Hugging Face checkpoint folder. KV capacity is
    ``num_blocks`` or, if that is None, as many blocks as fit in
    ``kv_cache_bytes`` (default 256 MiB, capped at what ``max_batch_size``
    sequences of ``max_model_len`` tokens could use).
    """

    model: str = "tiny"
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None  # float32 on CPU, bfloat16 (or the checkpoint's float16) on CUDA
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_batch_size: int = 256
    max_prefill_tokens: int | None = None  # prompt tokens admitted per step (scheduler)
    max_pass_tokens: int = 2048  # tokens per forward pass; longer prompts are chunked
    #: Tokens computed per step (chunked prefill: a longer prompt continues in the next steps,
    #: alongside the decodes); None: a prompt is prefilled in one step, however long.
    max_step_tokens: int | None = 2048
    #: Automatic prefix caching: a prompt's cached full blocks are shared, not computed again.
    prefix_cache: bool = True
    batch_invariant: bool = False
    #: ``step_async(exclusive=True)`` computes a step inline when it should take at most this long
    #: (estimated from the last step, scaled by tokens); longer ones go to a worker thread.
    inline_step_max_s: float = 0.05
    #: Where the model step computes: ``thread`` (this process: inline or a worker thread) or
    #: ``process`` (a child process holding the model, the KV pool in shared memory; CPU only).
    core: str = "thread"
    #: torch threads of the ``process`` core (default: this process's ``torch.get_num_threads()``).
    core_threads: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if self.core not in ("thread", "process"):
            raise ValueError(f"core must be 'thread' or 'process', got {self.core!r}")


class TorchEngine(ScheduledEngine):
    """The built-in engine; see the module docstring. Build with ``TorchEngine("tiny", num_blocks=64)``."""

    def __init__(self, config: TorchEngineConfig | str = "tiny", **overrides: object) -> None:
        if isinstance(config, str):
            config = TorchEngineConfig(model=config, **overrides)  # type: ignore[arg-type]
        elif overrides:
            config = dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
        self.config = config
        self.model: LlamaForCausalLM | None = None  # in this process (core "thread") only
        self._process: CoreProcess | None = None
        if config.core == "process":
            self._process = CoreProcess(
                config.model,
                seed=config.seed,
                device=config.device,
                dtype=config.dtype,
                threads=config.core_threads,
                batch_invariant=config.batch_invariant,
                max_pass_tokens=config.max_pass_tokens,
            )
            loaded = self._process.spec
        else:
            model = load_model(config.model, device=config.device, dtype=config.dtype, seed=config.seed)
            self.model = model.model
            loaded = LoadedSpec(model.config, model.model_id, model.revision, dtype_name(model.model.dtype))
        try:
            self._build(config, loaded)
        except BaseException:
            self.close()
            raise

    def _build(self, config: TorchEngineConfig, loaded: LoadedSpec) -> None:
        self.model_config: ModelConfig = loaded.config
        dtype = loaded.dtype
        shape = KVPoolShape.for_model(loaded.config, block_size=config.block_size, dtype=dtype)
        max_positions = loaded.config.max_position_embeddings
        max_model_len = min(config.max_model_len or max_positions, max_positions)
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
            num_blocks = shape.num_blocks_for_budget(budget)
            if config.kv_cache_bytes is None:
                num_blocks = min(num_blocks, config.max_batch_size * -(-max_model_len // config.block_size))
            if num_blocks <= 0:
                raise ValueError(f"a KV budget of {budget} bytes holds no {shape.bytes_per_block}-byte block")
        self._core: ModelCore | CoreProcess
        if self._process is not None:
            self.pool = self._process.shared_pool(shape, num_blocks)
            self._core = self._process
        else:
            assert self.model is not None
            self.pool = PagedKVPool(shape, num_blocks, device=config.device)
            runner = ModelRunner(
                self.model,
                self.pool,
                batch_invariant=config.batch_invariant,
                max_pass_tokens=config.max_pass_tokens,
            )
            self._core = ModelCore(runner)
        eos_ids = loaded.config.eos_token_ids
        self._eos_token_ids = eos_ids
        self.grammars = GrammarCompiler.for_model(config.model, loaded.config.vocab_size, eos_ids)
        self.scheduler = LocalScheduler(
            LocalSchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_model_len=max_model_len,
                vocab_size=loaded.config.vocab_size,
                eos_token_id=eos_ids[0] if eos_ids else None,
                max_batch_size=config.max_batch_size,
                max_prefill_tokens=config.max_prefill_tokens,
                max_step_tokens=config.max_step_tokens,
                prefix_cache=config.prefix_cache,
            ),
            constraints=self.grammars,
        )
        self._info = EngineInfo(
            engine="torch",
            model=ModelIdentity(model_id=loaded.model_id, revision=loaded.revision, dtype=dtype),
            kv_layout=KVLayout(
                num_layers=shape.num_layers,
                num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim,
                block_size=shape.block_size,
                dtype=dtype,
            ),
            num_blocks=num_blocks,
            block_size=config.block_size,
            bytes_per_block=shape.bytes_per_block,
            max_model_len=max_model_len,
            max_batch_size=config.max_batch_size,
            vocab_size=loaded.config.vocab_size,
            eos_token_id=eos_ids[0] if eos_ids else None,
        )
        self._events: list[SchedulerEvent] = []
        self._num_rejections = 0
        self._in_step = False
        self._deferred: list[tuple[str, str]] = []  # (action, request_id) that arrived mid-step
        self._last_step: tuple[float, int] | None = None  # (seconds, tokens) of the last computed step
        #: the prompt logprobs computed so far of requests that ask (``SamplingParams.prompt_logprobs``),
        #: per prompt position, until their first output carries them
        self._prompt_scores: dict[str, tuple[list[float | None], list[Alternatives]]] = {}

    # ------------------------------------------------------------ serving

    def _engine_sampling(self, request_id: str, sampling: SamplingParams) -> SamplingParams:
        """Validate sampling for this sampler; add the model's extra EOS ids as stop ids."""
        problem = check_sampling_params(sampling)
        if problem is not None:
            self._num_rejections += 1
            self._events.append(RejectionEvent(request_id, RejectReason.INVALID_SAMPLING, problem))
            raise RequestRejected(request_id, RejectReason.INVALID_SAMPLING, problem)
        extra = [t for t in self._eos_token_ids[1:] if t not in sampling.stop_token_ids]
        if extra and not sampling.ignore_eos:
            return msgspec.structs.replace(sampling, stop_token_ids=(*sampling.stop_token_ids, *extra))
        return sampling

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        if request_id in self.scheduler:
            return False
        sampling = self._engine_sampling(request_id, sampling)
        return self.scheduler.add_request(
            request_id, prompt_token_ids, sampling, priority, output_token_ids=output_token_ids
        )

    @property
    def overlaps_loop(self) -> bool:
        """A step computes in another process: the caller's loop may work meanwhile at no cost to it."""
        return self._process is not None

    def close(self) -> None:
        """Stop the engine core process, if there is one (idempotent; the engine is unusable after)."""
        if self._process is not None:
            self._process.close()

    def step(self) -> StepResult:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        work, rows = self._snapshot(plan)
        return self._complete(plan, self._compute(plan, work, rows), started)

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        work, rows = self._snapshot(plan)
        if not work:
            return self._complete(plan, _NOTHING, started)
        process = self._process
        expected = expected_step_s(self._last_step, plan.num_prefill_tokens + len(plan.decodes))
        if process is None and exclusive and expected <= self.config.inline_step_max_s:
            return self._complete(plan, self._compute(plan, work, rows), started)
        self._in_step = True
        try:
            if process is not None:
                step = self._step_work(plan, work, rows)
                sampled = self._sampled(plan, step, await process.compute_async(step))
            else:
                sampled = await asyncio.to_thread(self._compute, plan, work, rows)
        finally:
            self._in_step = False
        return self._complete(plan, sampled, started)

    def _scheduled(self, plan: SchedulerOutput) -> list[Request]:
        """The requests of ``plan`` in work order: prefills (chunks included), then decodes."""
        return [prefill.request for prefill in plan.prefills] + plan.decodes

    def _sampled_rows(self, plan: SchedulerOutput) -> list[int]:
        """Indices (in work order) of the sequences that sample a token: all but prompt chunks."""
        num_prefills = len(plan.prefills)
        rows = [i for i, prefill in enumerate(plan.prefills) if prefill.final]
        rows.extend(range(num_prefills, num_prefills + len(plan.decodes)))
        return rows

    def _snapshot(self, plan: SchedulerOutput) -> tuple[list[SequenceWork], list[SamplingRow]]:
        """Copy what the computation reads, so other calls may change the requests meanwhile."""
        work: list[SequenceWork] = []
        for prefill in plan.prefills:
            request = prefill.request
            tokens = request.all_token_ids[prefill.start : prefill.end]
            work.append(SequenceWork(tokens, prefill.start, tuple(request.block_ids)))
        for request in plan.decodes:
            last = request.all_token_ids[-1:]
            work.append(SequenceWork(last, request.num_computed_tokens, tuple(request.block_ids)))
        scheduled = self._scheduled(plan)
        sampled = [scheduled[i] for i in self._sampled_rows(plan)]
        rows = [self._sampling_row(request) for request in sampled]
        return work, with_grammar_masks(rows, [request.constraint for request in sampled], self.grammars)

    @staticmethod
    def _scoring(plan: SchedulerOutput) -> dict[int, PromptScoring]:
        """The prefills (by index in work order) whose prompt positions are scored: those of requests
        that ask for prompt logprobs and have generated nothing yet (a rescued or preempted request
        that has already delivered tokens delivered its prompt logprobs with the first of them)."""
        scoring: dict[int, PromptScoring] = {}
        for index, prefill in enumerate(plan.prefills):
            request = prefill.request
            k = request.sampling.prompt_logprobs
            if k is None or request.num_output_tokens:
                continue
            # position p predicts prompt token p + 1; the last prompt position predicts the output
            end = min(prefill.end + 1, request.num_prompt_tokens)
            # no target (a one-token prompt): scored all the same, so its first output says so
            scoring[index] = PromptScoring(request.all_token_ids[prefill.start + 1 : end], k)
        return scoring

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling
        num_output = request.num_output_tokens
        banned: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            eos = () if params.ignore_eos else self._eos_token_ids[:1]
            banned = (*eos, *params.stop_token_ids)
        return SamplingRow(
            params=params,
            seed=request_seed(request.request_id, params.seed),
            output_index=num_output,
            history=tuple(request.all_token_ids) if wants_history(params) else (),
            banned_token_ids=banned,
        )

    def _compute(self, plan: SchedulerOutput, work: list[SequenceWork], rows: list[SamplingRow]) -> _Sampled:
        if not work:
            return _NOTHING
        step = self._step_work(plan, work, rows)
        return self._sampled(plan, step, self._core.compute(step))

    def _step_work(
        self, plan: SchedulerOutput, work: list[SequenceWork], rows: list[SamplingRow]
    ) -> StepWork:
        return StepWork(work, self._sampled_rows(plan), rows, self._scoring(plan))

    def _sampled(self, plan: SchedulerOutput, step: StepWork, computed: Computed) -> _Sampled:
        """Request id -> sampled token and -> its logprob where asked, from a computed step (and the
        step's time, for ``exclusive``)."""
        token_ids, logprobs, top, seconds, scores = computed
        self._last_step = (seconds, plan.num_prefill_tokens + len(plan.decodes))
        scheduled = self._scheduled(plan)
        ids = [scheduled[i].request_id for i in step.sampled]
        tokens = dict(zip(ids, token_ids, strict=True))
        prefills = plan.prefills
        prompt = {prefills[i].request.request_id: (prefills[i].start + 1, got) for i, got in scores.items()}
        if not logprobs:
            return tokens, None, None, prompt
        values = {i: v for i, v in zip(ids, logprobs, strict=True) if v is not None}
        alternatives = {i: t for i, t in zip(ids, top, strict=True) if t is not None} if top else None
        return tokens, values, alternatives, prompt

    def _keep_prompt_scores(self, plan: SchedulerOutput, scores: dict[str, tuple[int, PromptScores]]) -> None:
        """File a step's prompt scores under their positions (a chunked prompt's come over several steps)."""
        for prefill in plan.prefills:
            found = scores.get(prefill.request.request_id)
            if found is None:
                continue
            request = prefill.request
            first, computed = found
            kept = self._prompt_scores.get(request.request_id)
            if kept is None:
                size = request.num_prompt_tokens
                kept = self._prompt_scores[request.request_id] = ([None] * size, [()] * size)
            values, top = kept
            values[first : first + len(computed.logprobs)] = computed.logprobs
            top[first : first + len(computed.top)] = computed.top

    def _with_prompt_scores(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Put each waiting request's prompt logprobs on its first output (``first_index`` 0)."""
        for index, output in enumerate(outputs):
            if output.first_index != 0:
                continue
            kept = self._prompt_scores.pop(output.request_id, None)
            if kept is not None:
                outputs[index] = msgspec.structs.replace(
                    output, prompt_logprobs=tuple(kept[0]), prompt_top_logprobs=tuple(kept[1])
                )
        return outputs

    def _complete(self, plan: SchedulerOutput, sampled: _Sampled, started: float) -> StepResult:
        tokens, logprobs, top, prompt = sampled
        if prompt:
            self._keep_prompt_scores(plan, prompt)
        outputs = self.scheduler.update_from_output(plan, tokens, logprobs, top)
        if self._prompt_scores:
            outputs = self._with_prompt_scores(outputs)
        if self._deferred:
            dropped = self._apply_deferred()
            outputs = [o for o in outputs if o.request_id not in dropped]
        return StepResult(
            outputs=outputs,
            duration_s=time.perf_counter() - started,
            num_scheduled=plan.num_scheduled,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_requests=len(plan.decodes),
            preempted=tuple(plan.preempted),
        )

    def _apply_deferred(self) -> set[str]:
        dropped: set[str] = set()
        deferred, self._deferred = self._deferred, []
        for action, request_id in deferred:
            dropped.add(request_id)
            self._prompt_scores.pop(request_id, None)
            if request_id not in self.scheduler:
                continue  # it finished in this step anyway
            if action == "abort":
                self.scheduler.abort(request_id)
            else:
                self.scheduler.release_request(request_id)
        return dropped

    def abort(self, request_id: str) -> bool:
        if self._in_step:
            if request_id not in self.scheduler or ("abort", request_id) in self._deferred:
                return False
            self._deferred.append(("abort", request_id))
            return True
        self._prompt_scores.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        return dataclasses.replace(stats, num_rejections=stats.num_rejections + self._num_rejections)

    def take_events(self) -> list[SchedulerEvent]:
        events = [*self._events, *self.scheduler.take_events()]
        self._events = []
        return events

    # ---------------------------------------------------------- migration

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (local block ids), for tests and diagnostics."""
        return tuple(self.scheduler.request(request_id).block_ids)

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer:
        """One gather of the blocks at ``block_indices`` of the request's table; payload is format v1."""
        table = self.scheduler.request(request_id).block_ids
        bad = [i for i in block_indices if not 0 <= i < len(table)]
        if bad:
            raise MigrationError(f"request {request_id!r} holds {len(table)} blocks; cannot export {bad[:5]}")
        buffer = self.pool.export([table[i] for i in block_indices])
        payload = buffer_to_bytes(buffer)
        return KVBuffer(len(block_indices), payload.nbytes, payload)

    def _payload_problem(self, buffer: KVBuffer) -> str | None:
        if memoryview(buffer.payload).nbytes != buffer.nbytes:
            return "the buffer carries no KV data (a sim buffer?); cannot import it"
        return None

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        """One scatter of a format-v1 buffer into reserved blocks."""
        self._check_import(block_ids, buffer)
        self.pool.import_(list(block_ids), buffer_from_bytes(buffer.payload, self.pool.shape))

    def admit_migrated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
        reservations: Sequence[Reservation],
        *,
        num_computed_tokens: int | None = None,
        cached_block_ids: Sequence[int] = (),
    ) -> None:
        """``cached_block_ids``: the request's leading blocks, held from this pool's prefix cache
        (:meth:`hold_cached_blocks`); the reservations' blocks follow them in its table."""
        sampling = self._engine_sampling(request_id, sampling)
        self.scheduler.admit_migrated(
            request_id,
            prompt_token_ids,
            output_token_ids,
            sampling,
            priority,
            [r.reservation_id for r in reservations],
            num_computed_tokens=num_computed_tokens,
            cached_block_ids=cached_block_ids,
        )

    def release_request(self, request_id: str) -> int:
        if self._in_step:
            request = self.scheduler.request(request_id)  # raises UnknownRequest
            if ("release", request_id) not in self._deferred:
                self._deferred.append(("release", request_id))
            return len(request.block_ids)
        self._prompt_scores.pop(request_id, None)
        return self.scheduler.release_request(request_id)
