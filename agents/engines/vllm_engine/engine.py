"""``VllmEngine``: the :class:`~agents.engines.protocol.Engine` over one in-process vLLM V1 ``EngineCore``.

vLLM owns admission, batching, preemption and the KV blocks; this adapter
feeds it token ids, runs its loop and reports what it sees. A step is
``EngineCore.step``'s three parts: ``schedule()`` and ``update_from_output()``
on the caller's thread, the model execution (``execute_model`` and
``sample_tokens``) always on the engine's one model thread (so the agent's
event loop keeps serving during ``step_async``, and one OpenMP team does all
the model's work). That thread is pinned to ``config.cpus`` with one torch
thread per CPU when they are given (:mod:`.cpu_binding`: vLLM's own CPU
binding, which it sets up only for worker processes). On a CPU with AMX the
process asks Linux for AMX tiles before the first step (:mod:`.amx`: vLLM's
bfloat16 attention uses them without asking). Calls that would
change the batch or free blocks while a step computes (abort, release,
suspend, resume) are applied when it
completes, as in the torch engine; the aborted requests' outputs of that step
are dropped.

Requests enter vLLM through its ``InputProcessor`` (validation, the
checkpoint's generation config and EOS) with shoal's request id kept as
vLLM's id, and leave detokenization to the frontend. A request that
continues after generated tokens (rescue, migration) reaches vLLM with them
appended to its prompt (see :mod:`.sampling`) and its grammar, if it has one
(vLLM's structured outputs), advanced over them before its first step
(:mod:`.structured`, which also honours a request's ``disable_any_whitespace``). Prompt
logprobs arrive with a request's first token (vLLM computes them with its
prefill, in chunks or not); ``max_tokens`` 0 runs one token and drops it. Stats come from vLLM's
scheduler and its KV block pool: block 0 is vLLM's null block, so capacity is
``num_gpu_blocks - 1``.

Prefix caching (``config.prefix_cache``, on by default) is vLLM's own: vLLM finds and
shares cached blocks at admission and evicts them when it needs room. Its KV cache events
(kept by :class:`~.scheduler.ShoalScheduler`) are folded after every step into shoal's
block hashes (:class:`~.prefix_cache.VllmCacheIndex`) for :meth:`VllmEngine.take_cache_delta`
and :meth:`VllmEngine.cached_block_hashes`; a request's cached tokens are vLLM's own count
from its first output (``PrefillStats``).

Migration (:mod:`.migration`: reservations from vLLM's block pool, block
export/import, admission by handing the reserved blocks to the request) and
:class:`~.scheduler.ShoalScheduler` (suspend/resume) hold the rest; this module
holds the serving half and delegates to them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.engines.block_manager import CacheDelta, Reservation
from agents.engines.protocol import (
    EngineInfo,
    EngineStats,
    InvalidRequestState,
    KVBuffer,
    PreemptionEvent,
    RejectionEvent,
    RejectReason,
    RequestOutput,
    RequestRejected,
    RequestStats,
    RequestStatus,
    SchedulerEvent,
    StepResult,
    UnknownRequest,
    expected_step_s,
)
from agents.engines.thread_name import name_os_thread
from agents.engines.vllm_engine.amx import request_amx_tiles
from agents.engines.vllm_engine.compat import require_vllm
from agents.engines.vllm_engine.config import VllmEngineConfig
from agents.engines.vllm_engine.prefix_cache import VllmCacheIndex, VllmHasher
from agents.engines.vllm_engine.sampling import migration_blocker, to_vllm_sampling
from agents.engines.vllm_engine.structured import advance_grammar, honour_request_whitespace
from schemas import Alternatives, FinishReason, KVLayout, ModelIdentity, SamplingParams

__all__ = ["VllmEngine"]

log = logging.getLogger(__name__)

#: vLLM keeps the forward pass's context (attention metadata, KV tensors per layer) in a module global
#: (``vllm.forward_context._forward_context``), so two engines in one process must never run their
#: model halves at once: that corrupts memory in the CPU attention kernel. One lock per process.
_EXECUTE_LOCK = threading.Lock()

#: vLLM's FinishReason (STOP, LENGTH, ABORT, ERROR, REPETITION) -> the wire's.
_FINISH = {
    0: FinishReason.STOP,
    1: FinishReason.LENGTH,
    2: FinishReason.ABORT,
    3: FinishReason.ABORT,
    4: FinishReason.STOP,
}


@dataclass(slots=True)
class _Tracked:
    """shoal's view of one unfinished request (vLLM holds the rest)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    arrival_seq: int
    num_preemptions: int = 0
    migration_blocker: str | None = None
    #: prompt tokens vLLM found in its prefix cache when it first admitted the request here
    num_cached_tokens: int = 0
    deferred: set[str] = field(default_factory=set)
    #: a fresh request that asked for prompt logprobs and has not had them yet
    wants_prompt_logprobs: bool = False


def _bind_model_thread(cpus: tuple[int, ...]) -> None:
    """Runs first on the model thread: pin it to ``cpus`` with one torch (OpenMP) thread per CPU.

    Linux affinity is per thread (``sched_setaffinity(0, ...)`` in this thread)
    and inherited by the OpenMP threads it starts; the agent's event loop stays
    free to run elsewhere. The thread count is set on this thread and fixed by
    its first use (``get_num_threads``); the caller puts torch's process-wide
    default back (:func:`_pin_model_thread`). ``torch._C.set_num_threads`` is
    ``torch.set_num_threads``, which vLLM's CPU worker replaces with a no-op.
    """
    import torch

    os.sched_setaffinity(0, cpus)
    torch._C.set_num_threads(len(cpus))
    if torch.get_num_threads() != len(cpus):
        raise RuntimeError(f"vllm engine: the model thread got {torch.get_num_threads()} torch threads")


def _fix_thread_count() -> int:
    """Runs first on an unpinned model thread: fix its torch (OpenMP) thread count now.

    torch sets a new thread's OpenMP team size lazily, at its first parallel op, to torch's
    process-wide count (``torch.set_num_threads`` anywhere in the process); until then OpenMP
    reports its own default (one per CPU). vLLM's CPU attention plans its work with the count
    OpenMP reports and then checks it while it runs, after torch's ops have changed it: a
    process whose count was set below the default failed that check
    (``metadata->thread_num == thread_num``). ``get_num_threads`` applies torch's count first.
    """
    import torch

    return torch.get_num_threads()


def _pin_model_thread(model_thread: concurrent.futures.ThreadPoolExecutor, cpus: tuple[int, ...]) -> None:
    """Pin the model thread to ``cpus`` (without CPUs: fix its thread count only), leaving the other
    threads as they were."""
    if not cpus:
        model_thread.submit(_fix_thread_count).result()
        return
    import torch

    previous = torch.get_num_threads()
    try:
        model_thread.submit(_bind_model_thread, cpus).result()
    finally:
        torch._C.set_num_threads(previous)  # this thread's and new threads' count; not the model thread's
    log.info("vllm engine: model thread pinned to CPUs %s with %d torch thread(s)", list(cpus), len(cpus))


def _engine_args(config: VllmEngineConfig) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = dict(
        model=config.model,
        tokenizer=config.model,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_batch_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        seed=config.seed,
        enforce_eager=config.enforce_eager,
        num_gpu_blocks_override=None if config.num_blocks is None else config.num_blocks + 1,  # + null block
        kv_cache_memory_bytes=config.kv_cache_bytes,
        disable_log_stats=True,
        async_scheduling=False,
        distributed_executor_backend="uni",  # one worker in this process: the engine reads its KV tensors
        scheduler_cls="agents.engines.vllm_engine.scheduler.ShoalScheduler",
    )
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    kwargs["enable_prefix_caching"] = config.prefix_cache
    if config.prefix_cache:  # its events name the cached blocks; kept by ShoalScheduler, not sent
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return EngineArgs(**kwargs)


def _hasher(vllm_config: Any) -> VllmHasher:
    """vLLM's key of a block and the hash its KV cache events name it by (its own functions)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)

    def hasher(parent: Any, tokens: Sequence[int]) -> tuple[Any, Any]:
        key = hash_block_tokens(hash_fn, parent, tokens)
        return key, maybe_convert_block_hash(key)

    return hasher


def _sampled_logprobs(lists: Any, num_tokens: int) -> tuple[float, ...] | None:
    """The sampled tokens' logprobs from vLLM's ``LogprobsLists`` (column 0 of each row)."""
    if lists is None or len(lists.logprobs) != num_tokens:
        return None
    return tuple(float(row[0]) for row in lists.logprobs)


def _top_logprobs(lists: Any, num_tokens: int) -> tuple[Alternatives, ...] | None:
    """The most likely tokens at each position, from vLLM's ``LogprobsLists`` (columns after the first)."""
    if lists is None or len(lists.logprobs) != num_tokens or len(lists.logprobs[0]) < 2:
        return None
    return tuple(
        tuple((int(t), float(v)) for t, v in zip(ids[1:], values[1:], strict=True))
        for ids, values in zip(lists.logprob_token_ids, lists.logprobs, strict=True)
    )


def _prompt_logprobs(
    tensors: Any, num_prompt_tokens: int
) -> tuple[tuple[float | None, ...], tuple[Alternatives, ...]] | None:
    """Each prompt token's logprob given the ones before it (the first has none) and the most
    likely tokens at each position, from vLLM's prompt ``LogprobsTensors`` (one row per prompt
    token after the first: column 0 the prompt token, then the alternatives); None when vLLM's
    rows do not cover the prompt."""
    if tensors is None:
        rows_ids: list[list[int]] = []
        rows: list[list[float]] = []
    else:
        rows_ids, rows = tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist()
    if len(rows) != num_prompt_tokens - 1:
        return None
    values: tuple[float | None, ...] = (None, *(float(row[0]) for row in rows))
    top: tuple[Alternatives, ...] = (
        (),
        *(
            tuple((int(t), float(v)) for t, v in zip(ids[1:], row[1:], strict=True))
            for ids, row in zip(rows_ids, rows, strict=True)
        ),
    )
    return values, top


class VllmEngine:
    """One vLLM V1 engine in this process; see the module docstring. ``VllmEngine("/path/to/ckpt")``."""

    #: ``suspend`` holds a queued request that never ran out of vLLM's queue, ``resume`` queues it
    #: again in its place (``ShoalScheduler.hold``): a move without KV (``agents.migration``).
    holds_queued_requests = True

    def __init__(self, config: VllmEngineConfig | str, **overrides: Any) -> None:
        if isinstance(config, str):
            config = VllmEngineConfig(model=config, **overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        version = require_vllm()
        if not Path(config.model).is_dir():
            raise FileNotFoundError(f"vllm engine: {config.model!r} is not a local checkpoint folder")
        from vllm.renderers import renderer_from_config
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor import Executor

        # vLLM's CPU platform swaps the in-process executor for worker processes unless told not to
        # by this variable (vllm/platforms/cpu.py); shoal needs the worker in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # every model execution runs on this one thread, bound before vLLM's CPU worker starts (it
        # replaces torch.set_num_threads with a no-op once it has set up its device)
        self._model_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="vllm-model", initializer=name_os_thread, initargs=("vllm-model",)
        )  # named for the kernel too: per-thread CPU tells the model's step from the agent's loop
        _pin_model_thread(self._model_thread, config.cpus)
        vllm_config = _engine_args(config).create_engine_config(UsageContext.ENGINE_CONTEXT)
        self.vllm_config = vllm_config
        if version.endswith("+cpu"):  # before any model step: vLLM's bfloat16 attention uses AMX tiles
            request_amx_tiles(str(vllm_config.model_config.dtype).removeprefix("torch."))
        self.core: Any = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=False)
        honour_request_whitespace(self.core.structured_output_manager)
        self.input_processor = InputProcessor(vllm_config, renderer_from_config(vllm_config))
        self._supported_tasks = self.core.get_supported_tasks()
        scheduler: Any = self.core.scheduler
        self.scheduler: Any = scheduler  # a ShoalScheduler
        self._block_pool = self.scheduler.kv_cache_manager.block_pool
        self._info = self._describe(version)
        self._cache = (
            VllmCacheIndex(self._info.block_size, _hasher(vllm_config)) if config.prefix_cache else None
        )
        self._requests: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()
        self._events: list[SchedulerEvent] = []
        self._num_rejections = 0
        self._num_finished = 0
        self._num_preemptions = 0
        self._in_step = False
        self._num_steps = 0
        #: (seconds, tokens) of the last model step, for ``step_async``'s choice
        self._last_step: tuple[float, int] | None = None
        self._deferred: list[tuple[str, str]] = []
        from agents.engines.vllm_engine.migration import MigrationSupport

        self.migration = MigrationSupport(self) if config.migration else None

    # ----------------------------------------------------------- identity

    def _describe(self, version: str) -> EngineInfo:
        model_config = self.vllm_config.model_config
        cache_config = self.vllm_config.cache_config
        hf = model_config.hf_text_config
        dtype = str(model_config.dtype).removeprefix("torch.")
        num_layers = model_config.get_num_layers(self.vllm_config.parallel_config)
        num_kv_heads = model_config.get_num_kv_heads(self.vllm_config.parallel_config)
        head_dim = model_config.get_head_size()
        block_size = cache_config.block_size
        kv_dtype = dtype if cache_config.cache_dtype == "auto" else str(cache_config.cache_dtype)
        element = {"float32": 4, "float16": 2, "bfloat16": 2}.get(kv_dtype, 1)
        config_bytes = (Path(self.config.model) / "config.json").read_bytes()
        platform = "cpu" if version.endswith("+cpu") else "cuda"
        eos = getattr(hf, "eos_token_id", None)
        return EngineInfo(
            engine="vllm",
            model=ModelIdentity(
                model_id=Path(self.config.model).name,
                # vLLM's KV layout differs from the torch engine's: never exchange blocks with it
                revision=f"{hashlib.sha256(config_bytes).hexdigest()[:16]}+vllm-{platform}",
                dtype=dtype,
                tensor_parallel=self.vllm_config.parallel_config.tensor_parallel_size,
            ),
            kv_layout=KVLayout(
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                dtype=kv_dtype,
            ),
            num_blocks=self._block_pool.num_gpu_blocks - 1,
            block_size=block_size,
            bytes_per_block=2 * num_layers * num_kv_heads * head_dim * block_size * element,
            max_model_len=model_config.max_model_len,
            max_batch_size=self.vllm_config.scheduler_config.max_num_seqs,
            vocab_size=model_config.get_vocab_size(),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    # ------------------------------------------------------------ serving

    def _reject(self, request_id: str, reason: RejectReason, detail: str) -> RequestRejected:
        self._num_rejections += 1
        self._events.append(RejectionEvent(request_id, reason, detail))
        return RequestRejected(request_id, reason, detail)

    def _check(self, request_id: str, tokens: Sequence[int], sampling: SamplingParams, done: int) -> None:
        info = self._info
        if not tokens:
            raise self._reject(request_id, RejectReason.EMPTY_PROMPT, "the prompt has no tokens")
        bad = [t for t in tokens if not 0 <= t < info.vocab_size]
        if bad:
            raise self._reject(
                request_id, RejectReason.TOKEN_OUT_OF_RANGE, f"token ids {bad[:5]} out of range"
            )
        if len(tokens) >= info.max_model_len:
            raise self._reject(
                request_id,
                RejectReason.EXCEEDS_MODEL_CONTEXT,
                f"{len(tokens)} tokens, the model's context is {info.max_model_len}",
            )
        if -(-len(tokens) // info.block_size) > info.num_blocks:
            raise self._reject(request_id, RejectReason.EXCEEDS_CAPACITY, f"{len(tokens)} tokens do not fit")
        # a fresh request may ask for no tokens (its prompt logprobs only); a continued one has some left
        if sampling.max_tokens - done < (0 if done == 0 else 1) or sampling.min_tokens < 0:
            raise self._reject(
                request_id, RejectReason.INVALID_SAMPLING, "max_tokens must exceed the tokens done"
            )

    def _submit(
        self, request_id: str, tokens: Sequence[int], sampling: SamplingParams, done: int, priority: int
    ) -> Any:
        """Build vLLM's request (keeping shoal's id) and hand it to the scheduler; returns it.

        A constraint vLLM refuses (its validation parses the grammar or schema) is a rejection
        with vLLM's reason. A continued request's grammar is advanced over the ``done`` tokens it
        generated before (the last ones of ``tokens``) once vLLM has compiled it.
        """
        from vllm.exceptions import VLLMClientError

        try:
            request = self.input_processor.process_inputs(
                request_id,
                {"prompt_token_ids": list(tokens)},
                to_vllm_sampling(sampling, done),
                supported_tasks=self._supported_tasks,
                priority=priority,
            )
        except (ValueError, VLLMClientError) as exc:
            raise self._reject(request_id, RejectReason.INVALID_SAMPLING, str(exc)) from exc
        core_request, wave = self.core.preprocess_add_request(request)
        if done and core_request.structured_output_request is not None:
            advance_grammar(core_request.structured_output_request, request_id, list(tokens[-done:]))
        self.core.add_request(core_request, wave)
        return core_request

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        if request_id in self._requests:
            return False
        tokens = (*prompt_token_ids, *output_token_ids)
        self._check(request_id, tokens, sampling, len(output_token_ids))
        self._submit(request_id, tokens, sampling, len(output_token_ids), priority)
        self._requests[request_id] = _Tracked(
            tuple(prompt_token_ids),
            list(output_token_ids),
            sampling,
            priority,
            next(self._arrivals),
            migration_blocker=migration_blocker(sampling),
            wants_prompt_logprobs=sampling.prompt_logprobs is not None and not output_token_ids,
        )
        return True

    def step(self) -> StepResult:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        return self._complete(plan, self._model_thread.submit(self._execute, plan).result(), started)

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        """A step; an ``exclusive`` caller's loop waits blocked for a short one (no hand-off, no GIL
        shared with the loop), any other is awaited while the model thread computes it."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        num_tokens = plan.total_num_scheduled_tokens
        short = exclusive and expected_step_s(self._last_step, num_tokens) <= self.config.inline_step_max_s
        if num_tokens == 0 or short:
            return self._complete(plan, self._model_thread.submit(self._execute, plan).result(), started)
        self._in_step = True
        try:
            output = await asyncio.wrap_future(self._model_thread.submit(self._execute, plan))
        finally:
            self._in_step = False
        return self._complete(plan, output, started)

    def _execute(self, plan: Any) -> Any:
        """The model half of a step (touches only the worker: safe in a thread, one engine at a time)."""
        with _EXECUTE_LOCK:
            started = time.perf_counter()
            output = self._execute_locked(plan)
            self._last_step = (time.perf_counter() - started, plan.total_num_scheduled_tokens)
            return output

    def _execute_locked(self, plan: Any) -> Any:
        executor = self.core.model_executor
        output = executor.execute_model(plan)
        if output is None:
            output = executor.sample_tokens(self.scheduler.get_grammar_bitmask(plan))
        return output

    def _complete(self, plan: Any, model_output: Any, started: float) -> StepResult:
        running_before = (
            {r.request_id: len(self._block_ids(r.request_id)) for r in self.scheduler.running}
            if plan.preempted_req_ids
            else {}
        )
        core_outputs = self.scheduler.update_from_output(plan, model_output)
        self._num_steps += 1
        if self._cache is not None:
            self._cache.fold(self.scheduler.take_kv_events())
        dropped = self._apply_deferred() if self._deferred else set()
        outputs: list[RequestOutput] = []
        for client_outputs in core_outputs.values():
            for out in client_outputs.outputs:
                tracked = self._requests.get(out.request_id)
                if tracked is None or out.request_id in dropped:
                    continue
                first = len(tracked.output_token_ids)
                if out.prefill_stats is not None:  # vLLM hands it over with a request's first output
                    tracked.num_cached_tokens = out.prefill_stats.num_cached_tokens
                finish = None if out.finish_reason is None else _FINISH[int(out.finish_reason)]
                new = tuple(out.new_token_ids)
                lists = out.new_logprobs
                if tracked.sampling.max_tokens == 0:  # the one token run for the prompt logprobs
                    new, lists = (), None
                tracked.output_token_ids.extend(new)
                logprobs, top = _sampled_logprobs(lists, len(new)), _top_logprobs(lists, len(new))
                num_prompt = len(tracked.prompt_token_ids)
                scored = None
                if tracked.wants_prompt_logprobs:  # vLLM delivers them all with the first token
                    tracked.wants_prompt_logprobs = False
                    scored = _prompt_logprobs(out.new_prompt_logprobs_tensors, num_prompt)
                    if scored is None:
                        log.error(
                            "vllm engine: request %s got no prompt logprobs for its %d prompt tokens",
                            out.request_id,
                            num_prompt,
                        )
                outputs.append(
                    RequestOutput(
                        out.request_id,
                        first,
                        new,
                        finish,
                        num_prompt,
                        logprobs,
                        top,
                        num_cached_tokens=tracked.num_cached_tokens,
                        prompt_logprobs=None if scored is None else scored[0],
                        prompt_top_logprobs=None if scored is None else scored[1],
                    )
                )
                if finish is not None:
                    self._forget(out.request_id)
        preempted = tuple(sorted(plan.preempted_req_ids or ()))
        for request_id in preempted:
            tracked = self._requests.get(request_id)
            if tracked is not None:
                tracked.num_preemptions += 1
                self._num_preemptions += 1
                self._events.append(
                    PreemptionEvent(request_id, self._num_steps, running_before.get(request_id, 0))
                )
        return StepResult(
            outputs=outputs,
            duration_s=time.perf_counter() - started,
            num_scheduled=len(plan.num_scheduled_tokens),
            num_prefill_tokens=sum(n for rid, n in plan.num_scheduled_tokens.items() if n > 1),
            num_decode_requests=sum(1 for n in plan.num_scheduled_tokens.values() if n == 1),
            preempted=preempted,
        )

    def _forget(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._num_finished += 1

    def _apply_deferred(self) -> set[str]:
        dropped: set[str] = set()
        deferred, self._deferred = self._deferred, []
        for action, request_id in deferred:
            if action == "abort":
                dropped.add(request_id)
                self._abort_now(request_id)
            elif action == "release":
                dropped.add(request_id)
                self._release_now(request_id)
            elif action == "suspend":
                self.scheduler.suspend(request_id)
            else:
                self.scheduler.resume(request_id)
        return dropped

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _abort_now(self, request_id: str) -> bool:
        from vllm.v1.request import RequestStatus as VllmStatus

        if request_id not in self._requests:
            return False
        self.scheduler.finish_requests(request_id, VllmStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        if request_id not in self._requests:
            return False
        if self._in_step:
            if ("abort", request_id) in self._deferred:
                return False
            self._deferred.append(("abort", request_id))
            return True
        return self._abort_now(request_id)

    # -------------------------------------------------------------- stats

    def _block_ids(self, request_id: str) -> tuple[int, ...]:
        if request_id not in self.scheduler.requests:
            return ()
        groups = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return tuple(groups[0]) if groups else ()

    def _status(self, request_id: str, vllm_request: Any) -> RequestStatus:
        from vllm.v1.request import RequestStatus as VllmStatus

        if request_id in self.scheduler.suspended or request_id in self.scheduler.held:
            return RequestStatus.SUSPENDED
        if vllm_request.status == VllmStatus.RUNNING:
            return RequestStatus.RUNNING
        if vllm_request.status == VllmStatus.PREEMPTED:
            return RequestStatus.PREEMPTED
        return RequestStatus.WAITING

    def request_stats(self, request_id: str) -> RequestStats | None:
        tracked = self._requests.get(request_id)
        vllm_request = self.scheduler.requests.get(request_id)
        if tracked is None or vllm_request is None:
            return None
        status = self._status(request_id, vllm_request)
        return RequestStats(
            request_id=request_id,
            status=status,
            priority=tracked.priority,
            num_blocks=len(self._block_ids(request_id)) if status.holds_blocks else 0,
            num_tokens=len(tracked.prompt_token_ids) + len(tracked.output_token_ids),
            num_prompt_tokens=len(tracked.prompt_token_ids),
            num_computed_tokens=vllm_request.num_computed_tokens,
            num_preemptions=tracked.num_preemptions,
            arrival_seq=tracked.arrival_seq,
        )

    def migration_blocker(self, request_id: str) -> str | None:
        """Why a request may not be migrated (see :mod:`.sampling`), or None; UnknownRequest if absent."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            raise UnknownRequest(request_id)
        if self.migration is None:
            return "this vllm engine was built without migration"
        if tracked.wants_prompt_logprobs:
            return "its prompt logprobs are computed with its prefill and not delivered yet"
        return tracked.migration_blocker

    def stats(self) -> EngineStats:
        requests = [s for rid in list(self._requests) if (s := self.request_stats(rid)) is not None]
        requests.sort(key=lambda s: (not s.status.holds_blocks, s.arrival_seq))
        waiting = [s for s in requests if s.status.is_queued]
        head = min(waiting, key=lambda s: (s.priority, s.arrival_seq), default=None)
        reserved = 0 if self.migration is None else self.migration.num_reserved_blocks
        queries, hits = self.scheduler.prefix_cache_counts()
        return EngineStats(
            num_total_blocks=self._info.num_blocks,
            num_free_blocks=self._block_pool.get_num_free_blocks(),
            num_reserved_blocks=reserved,
            num_running=sum(1 for s in requests if s.status is RequestStatus.RUNNING),
            num_suspended=sum(1 for s in requests if s.status is RequestStatus.SUSPENDED),
            num_waiting=len(waiting),
            head_of_line_demand=0 if head is None else -(-head.num_tokens // self._info.block_size),
            head_of_line_priority=0 if head is None else head.priority,
            num_preemptions=self._num_preemptions,
            num_rejections=self._num_rejections,
            num_finished=self._num_finished,
            requests=tuple(requests),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_evictions=0 if self._cache is None else self._cache.num_evictions,
            num_cached_blocks=0 if self._cache is None else len(self._block_pool.cached_block_hash_to_block),
        )

    def output_token_ids(self, request_id: str) -> tuple[int, ...]:
        tracked = self._requests.get(request_id)
        if tracked is None:
            raise UnknownRequest(request_id)
        return tuple(tracked.output_token_ids)

    def take_events(self) -> list[SchedulerEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------- prefix cache

    def take_cache_delta(self) -> CacheDelta:
        """The shoal block hashes vLLM's prefix cache stored and removed since the last call (net);
        empty with prefix caching off."""
        if self._cache is None:
            return CacheDelta()
        self._cache.fold(self.scheduler.take_kv_events())
        return self._cache.take_delta()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds and zero the cache's counters (after the
        warm-up). The removals stay in the next delta (a reset with every block free is a
        ``cleared`` one)."""
        if self._cache is None:
            return
        self.scheduler.forget_cached_blocks()
        self._cache.fold(self.scheduler.take_kv_events())
        self._cache.num_evictions = 0

    def cached_block_hashes(self) -> list[int]:
        """The shoal hash of every block vLLM's prefix cache holds now, checked against its block
        pool (a full re-sync); empty with prefix caching off."""
        if self._cache is None:
            return []
        self._cache.fold(self.scheduler.take_kv_events())
        self._cache.reconcile(self.scheduler.cached_block_hashes())
        return self._cache.hashes()

    def shutdown(self) -> None:
        """Stop vLLM's executor (frees the KV cache and the worker).

        Waits for a model execution still in flight (a step whose awaiting task
        was cancelled, as when its agent is killed, keeps computing in its thread).
        """
        with _EXECUTE_LOCK:
            self.core.shutdown()
        self._model_thread.shutdown(wait=False)

    # ---------------------------------------------------------- migration

    def _migration(self) -> Any:
        if self.migration is None:
            raise InvalidRequestState("this vllm engine was built without migration (migration=False)")
        return self.migration

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer:
        result: KVBuffer = self._migration().export_blocks(request_id, block_indices)
        return result

    def reserve(self, num_blocks: int) -> Reservation:
        result: Reservation = self._migration().reserve(num_blocks)
        return result

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        self._migration().import_blocks(block_ids, buffer)

    def hold_cached_blocks(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        """For an incoming migration: one reference to each block vLLM's prefix cache holds of the
        longest leading run of ``block_hashes`` (the request's chain), so none is evicted before
        the admission takes them (``admit_migrated(cached_block_ids=...)``) or
        :meth:`drop_held_blocks`. ``()`` with the prefix cache off or without migration."""
        if self.migration is None:
            return ()
        result: tuple[int, ...] = self.migration.hold_cached_blocks(block_hashes)
        return result

    def drop_held_blocks(self, block_ids: Sequence[int]) -> None:
        if self.migration is not None:
            self.migration.drop_held_blocks(block_ids)

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
        self._migration().admit_migrated(
            request_id,
            prompt_token_ids,
            output_token_ids,
            sampling,
            priority,
            reservations,
            num_computed_tokens=num_computed_tokens,
            cached_block_ids=cached_block_ids,
        )

    def _release_now(self, request_id: str) -> int:
        from vllm.v1.request import RequestStatus as VllmStatus

        freed = len(self._block_ids(request_id))
        self.scheduler.finish_requests(request_id, VllmStatus.FINISHED_ABORTED)
        self._requests.pop(request_id, None)
        return freed

    def release_request(self, request_id: str) -> int:
        if request_id not in self._requests:
            raise UnknownRequest(request_id)
        if self._in_step:
            if ("release", request_id) not in self._deferred:
                self._deferred.append(("release", request_id))
            return len(self._block_ids(request_id))
        return self._release_now(request_id)

    def release_reservation(self, reservation: Reservation) -> int:
        result: int = self._migration().release_reservation(reservation)
        return result

    def suspend(self, request_id: str) -> None:
        """Leave a running request out of the batch; or hold a queued one that never ran out of
        vLLM's queue (a move without KV: at once, the step in flight never scheduled it)."""
        if request_id not in self._requests:
            raise UnknownRequest(request_id)
        stats = self.request_stats(request_id)
        if stats is not None and stats.status is RequestStatus.WAITING and self.scheduler.hold(request_id):
            return
        if stats is None or stats.status is not RequestStatus.RUNNING:
            raise InvalidRequestState(f"request {request_id!r} is not running")
        if self._in_step:
            self._deferred.append(("suspend", request_id))
        elif not self.scheduler.suspend(request_id):
            raise InvalidRequestState(f"request {request_id!r} is not running")

    def resume(self, request_id: str) -> None:
        if request_id not in self._requests:
            raise UnknownRequest(request_id)
        if self.scheduler.unhold(request_id):  # a held queued request: back in the queue
            return
        if self._in_step:
            self._deferred.append(("resume", request_id))
        elif not self.scheduler.resume(request_id):
            raise InvalidRequestState(f"request {request_id!r} is not suspended")
