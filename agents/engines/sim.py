"""The ``sim`` engine: shoal's local scheduler and block manager with a timing model instead of tensors.

It schedules, batches, preempts and accounts KV blocks exactly like the torch
engine (they share :mod:`agents.engines.local_scheduler`), and instead of running a
model it takes the step time from a profile (:mod:`agents.engines.profile`).

Two ways to drive it:

* **virtual clock** (the cluster simulator): ``result = engine.step()`` returns
  at once; the simulator advances its clock by ``result.duration_s``. Or
  ``plan, d = engine.begin_step()`` now and ``engine.end_step(plan, d)`` once
  ``d`` has passed, so that calls in between see the engine mid-step;
* **real time** (live tests, scale benchmarks): ``await engine.step_async()``
  schedules, sleeps the modeled duration, then completes the step; other calls
  (add, abort, migration) may run during the sleep. ``run_until_idle`` loops it.

Token ids are deterministic: output token ``k`` of request ``r`` is a hash of
``(r, sampling.seed, k)`` modulo the vocabulary, never the EOS id. So a request
produces the same tokens whether or not it migrates, and its length is set by
``max_tokens`` (or a stop token id, or the context/capacity limits). There is no
model, hence no logprobs: a request's outputs carry none, and a request for prompt
logprobs (``SamplingParams.prompt_logprobs``) is refused (``INVALID_SAMPLING``, which
the frontend answers with a 400 naming the reason) rather than answered with made-up
numbers; echo and ``max_tokens`` 0 work (the prompt's text needs no model).

Structured outputs are enforced as in the torch engine (:mod:`agents.engines.grammar`,
over the byte tokenizer the frontend uses for ``sim:<profile>``: ids 0..255 are bytes,
257 the end): token ``k`` of a constrained request is the id at the hash's index among
the ids its grammar allows there, so the text is valid JSON / matches the regex / is one
of the choices, and is the same with or without a migration (the destination rebuilds
the grammar's state from the tokens). A request stops when its grammar is complete, or
when the pick is the end where the grammar allows one. The pick is uniform among the
allowed ids, not a language model: a string without ``maxLength`` may not close within
``max_tokens``.

The other sampling parameters (temperature, top-k, top-p, min-p, penalties, logit bias)
are accepted and change nothing: the sim's next-token distribution is a point mass on the
hashed token, which no finite bias and no truncation moves.

KV buffers carry no tensors: ``export_blocks`` returns a :class:`KVBuffer` whose
``nbytes`` is the real KV size and whose payload is 8 bytes per block, a
fingerprint of (request, block index). ``admit_migrated`` checks that every
block holding computed tokens received the right fingerprint, so a lost or
misplaced block is an error, not a silent success.
"""

from __future__ import annotations

import asyncio
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path

from agents.engines.block_manager import Reservation
from agents.engines.grammar import GrammarCompiler, GrammarMatcher, nth_allowed
from agents.engines.local_scheduler import LocalScheduler, LocalSchedulerConfig, SchedulerOutput
from agents.engines.profile import EngineProfile, TimingModel, load_profile
from agents.engines.protocol import (
    EngineInfo,
    KVBuffer,
    MigrationError,
    RejectReason,
    RequestOutput,
    RequestRejected,
    StepResult,
)
from agents.engines.scheduled import ScheduledEngine
from schemas import SamplingParams

__all__ = ["SimEngine", "sim_token_id"]

_MASK64 = (1 << 64) - 1
_FINGERPRINT_BYTES = 8
#: the byte tokenizer's ids (bytes, BOS, EOS, PAD): a smaller vocabulary takes no grammar
_MIN_GRAMMAR_VOCAB = 259


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _request_key(request_id: str, seed: int | None) -> int:
    key = _mix64(zlib.crc32(request_id.encode()))
    if seed is not None:
        key ^= _mix64(seed & _MASK64) << 1
    return key


def sim_token_id(
    request_id: str, seed: int | None, index: int, vocab_size: int, eos_token_id: int | None
) -> int:
    """Output token ``index`` of a sim request: deterministic, in range, never EOS."""
    return _token_from_key(_request_key(request_id, seed), index, vocab_size, eos_token_id)


def _token_hash(key: int, index: int) -> int:
    h = ((key + index) * 0x9E3779B97F4A7C15) & _MASK64
    return h ^ (h >> 29)


def _token_from_key(key: int, index: int, vocab_size: int, eos_token_id: int | None) -> int:
    h = _token_hash(key, index)
    if eos_token_id is None:
        return h % vocab_size
    token = h % (vocab_size - 1)
    return token + 1 if token >= eos_token_id else token


def _block_fingerprint(request_id: str, block_index: int) -> int:
    return _mix64((zlib.crc32(request_id.encode()) << 20) ^ block_index)


class SimEngine(ScheduledEngine):
    """An :class:`~agents.engines.protocol.Engine` with a timing model. See the module docstring."""

    def __init__(
        self,
        profile: EngineProfile | str | Path = "tiny-test",
        *,
        num_blocks: int | None = None,
        max_batch_size: int | None = None,
        max_prefill_tokens: int | None = None,
        max_step_tokens: int | None = None,
        time_scale: float = 1.0,
        prefix_cache: bool = False,
    ) -> None:
        """``time_scale`` multiplies every modeled duration (0.1 runs ten times faster than modeled).

        ``max_step_tokens``: chunked prefill, at most that many tokens computed per step (the
        local scheduler's rule, as the torch engine runs it); None: a prompt prefills in one step.
        ``prefix_cache``: automatic prefix caching; a hit is charged prefill only for the tokens
        not found cached (the local scheduler starts the prefill after them), plus their attention
        over the cached prefix (:meth:`modeled_duration_s`).
        """
        if not isinstance(profile, EngineProfile):
            profile = load_profile(profile)
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.profile = profile
        self.timing = TimingModel(profile)
        self.time_scale = time_scale
        num_blocks = profile.num_blocks if num_blocks is None else num_blocks
        max_batch_size = profile.max_batch_size if max_batch_size is None else max_batch_size
        self._info = EngineInfo(
            engine="sim",
            model=profile.model_identity,
            kv_layout=profile.kv_layout,
            num_blocks=num_blocks,
            block_size=profile.block_size,
            bytes_per_block=profile.kv_bytes_per_block,
            max_model_len=profile.max_model_len,
            max_batch_size=max_batch_size,
            vocab_size=profile.vocab_size,
            eos_token_id=profile.eos_token_id,
        )
        #: structured outputs over the byte tokenizer (None: a vocabulary too small for it)
        vocab = profile.vocab_size
        self.grammars = GrammarCompiler.for_bytes(vocab) if vocab >= _MIN_GRAMMAR_VOCAB else None
        self.scheduler = LocalScheduler(
            LocalSchedulerConfig(
                num_blocks=num_blocks,
                block_size=profile.block_size,
                max_model_len=profile.max_model_len,
                vocab_size=profile.vocab_size,
                eos_token_id=profile.eos_token_id,
                max_batch_size=max_batch_size,
                max_prefill_tokens=max_prefill_tokens,
                max_step_tokens=max_step_tokens,
                prefix_cache=prefix_cache,
            ),
            constraints=self.grammars,
        )
        self._imported: dict[int, int] = {}  # reserved block id -> fingerprint written into it
        self._token_keys: dict[str, int] = {}  # request id -> token hash key, while it runs here
        self._chunk_ends: dict[str, int] = {}  # request id -> end of its last chunk, mid-prefill

    # ------------------------------------------------------------ serving

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        if sampling.prompt_logprobs is not None and request_id not in self.scheduler:
            self.scheduler.num_rejections += 1
            detail = "prompt logprobs need a model; the sim engine has none"
            raise RequestRejected(request_id, RejectReason.INVALID_SAMPLING, detail)
        return super().add_request(
            request_id, prompt_token_ids, sampling, priority, output_token_ids=output_token_ids
        )

    def step(self) -> StepResult:
        plan = self.scheduler.schedule()
        outputs = self.scheduler.update_from_output(plan, self._sample(plan))
        return self._result(plan, outputs)

    def begin_step(self) -> tuple[SchedulerOutput, float]:
        """Plan one step without completing it: ``(plan, modeled duration in seconds)``.

        For virtual-clock drivers that let the step's time pass before its
        tokens exist (the cluster simulator): finish it with :meth:`end_step`.
        Calls in between (add, abort, suspend, release) see the engine as it is
        *during* the step, as with :meth:`step_async`.
        """
        plan = self.scheduler.schedule()
        return plan, self.modeled_duration_s(plan)

    def end_step(self, plan: SchedulerOutput, duration_s: float) -> StepResult:
        """Complete a step planned by :meth:`begin_step` (its tokens, stop rules, freed blocks)."""
        outputs = self.scheduler.update_from_output(plan, self._sample(plan))
        return self._result(plan, outputs, duration_s)

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        plan = self.scheduler.schedule()
        duration = self.modeled_duration_s(plan)
        if duration > 0:
            await asyncio.sleep(duration)
        outputs = self.scheduler.update_from_output(plan, self._sample(plan))
        return self._result(plan, outputs)

    def modeled_duration_s(self, plan: SchedulerOutput) -> float:
        """The profile's time for a planned step, times ``time_scale``.

        A prefill that starts after tokens already computed also pays attention over them:

        * the next chunk of a chunked prefill (``max_step_tokens``) pays
          ``prefill(end) - prefill(start) - prefill(chunk)`` on top of the chunk's own time, so
          chunking spreads a prompt's work over steps without making it cheaper;
        * the first pass after a prefix-cache hit is a pass over the uncached tokens alone plus
          their attention over the cached prefix: ``2 c start chunk`` on top of the chunk's own
          time (``c``: the profile's quadratic coefficient, as across the prompts of one step).
        """
        timing = self.timing
        seconds = timing.step_s(
            len(plan.decodes),
            plan.num_decode_context_tokens,
            plan.num_prefill_tokens,
            [chunk.num_tokens for chunk in plan.prefills],
        )
        chunk_ends = self._chunk_ends
        for chunk in plan.prefills:
            start = chunk.start
            if start <= 0:
                continue
            if chunk_ends.get(chunk.request.request_id) == start:  # the next chunk of a chunked prefill
                whole_ms = timing.prefill_ms(chunk.end) - timing.prefill_ms(start)
                prefix_ms = whole_ms - timing.prefill_ms(chunk.num_tokens)
                seconds += max(prefix_ms, 0.0) / 1000.0
            else:  # the first pass over a prefix found cached (or imported)
                seconds += 2.0 * timing.attention_ms_per_token2 * start * chunk.num_tokens / 1000.0
        return seconds * self.time_scale

    def _track_chunks(self, plan: SchedulerOutput) -> None:
        """Remember where each unfinished prefill stopped, once its step is complete."""
        chunk_ends = self._chunk_ends
        for chunk in plan.prefills:
            if chunk.final:
                chunk_ends.pop(chunk.request.request_id, None)
            elif chunk.request.status.holds_blocks:  # not aborted or released meanwhile
                chunk_ends[chunk.request.request_id] = chunk.end
        for request_id in plan.preempted:
            chunk_ends.pop(request_id, None)

    def _sample(self, plan: SchedulerOutput) -> dict[str, int]:
        vocab = self._info.vocab_size
        eos = self._info.eos_token_id
        keys = self._token_keys
        sampled: dict[str, int] = {}
        constrained: list[tuple[str, int, GrammarMatcher]] = []
        for r in [p.request for p in plan.prefills] + plan.decodes:
            rid = r.request_id
            key = keys.get(rid)
            if key is None:
                key = keys[rid] = _request_key(rid, r.sampling.seed)
            index = len(r.all_token_ids) - r.num_prompt_tokens
            if isinstance(r.constraint, GrammarMatcher):
                constrained.append((rid, _token_hash(key, index), r.constraint))
            else:
                sampled[rid] = _token_from_key(key, index, vocab, eos)
        if constrained and self.grammars is not None:
            masks = self.grammars.fill_bitmasks([matcher for _, _, matcher in constrained])
            for (rid, h, matcher), mask in zip(constrained, masks, strict=True):
                token = nth_allowed(mask, matcher.vocab_size, h)
                sampled[rid] = self.grammars.eos_token_id if token is None else token
        return sampled

    def _result(
        self, plan: SchedulerOutput, outputs: list[RequestOutput], duration_s: float | None = None
    ) -> StepResult:
        keys = self._token_keys
        for output in outputs:
            if output.finish_reason is not None:
                keys.pop(output.request_id, None)
        if duration_s is None:
            duration_s = self.modeled_duration_s(plan)
        self._track_chunks(plan)
        return StepResult(
            outputs=outputs,
            duration_s=duration_s,
            num_scheduled=plan.num_scheduled,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_requests=len(plan.decodes),
            preempted=tuple(plan.preempted),
        )

    def abort(self, request_id: str) -> bool:
        self._token_keys.pop(request_id, None)
        self._chunk_ends.pop(request_id, None)
        return self.scheduler.abort(request_id)

    # ---------------------------------------------------------- migration

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer:
        request = self.scheduler.request(request_id)
        num_held = len(request.block_ids)
        bad = [i for i in block_indices if not 0 <= i < num_held]
        if bad:
            raise MigrationError(f"request {request_id!r} holds {num_held} blocks; cannot export {bad[:5]}")
        payload = array("Q", (_block_fingerprint(request_id, i) for i in block_indices)).tobytes()
        num_blocks = len(block_indices)
        return KVBuffer(num_blocks, num_blocks * self._info.bytes_per_block, payload)

    def _payload_problem(self, buffer: KVBuffer) -> str | None:
        if len(buffer.payload) != _FINGERPRINT_BYTES * buffer.num_blocks:
            return "not a sim KV buffer (payload size does not match)"
        return None

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        self._check_import(block_ids, buffer)
        fingerprints = array("Q")
        fingerprints.frombytes(bytes(buffer.payload))
        for block_id, fingerprint in zip(block_ids, fingerprints, strict=True):
            self._imported[block_id] = fingerprint

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
        """The blocks after ``cached_block_ids`` (held from this instance's prefix cache, checked
        by the scheduler against the request's chain) must have received their fingerprints."""
        num_cached = len(cached_block_ids)
        table = [b for r in reservations for b in r.block_ids]
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        computed = num_tokens - 1 if num_computed_tokens is None else num_computed_tokens
        num_filled = self.scheduler.blocks.blocks_for_tokens(computed)
        for index, block_id in enumerate(table[: max(num_filled - num_cached, 0)], start=num_cached):
            if self._imported.get(block_id) != _block_fingerprint(request_id, index):
                raise MigrationError(
                    f"block {index} of request {request_id!r} (local block {block_id}) was not imported"
                )
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
        for block_id in table:
            self._imported.pop(block_id, None)

    def release_request(self, request_id: str) -> int:
        self._token_keys.pop(request_id, None)
        self._chunk_ends.pop(request_id, None)
        return self.scheduler.release_request(request_id)

    def release_reservation(self, reservation: Reservation) -> int:
        for block_id in reservation.block_ids:
            self._imported.pop(block_id, None)
        return self.scheduler.release_reservation(reservation.reservation_id)
