"""A drill's verdicts, computed from what happened: requests, agents' blocks, the event log.

* **requests**: every accepted request ends ``ok`` or with a clear retryable
  ``error``; ``lost`` (never ended, or short without an error) must be 0;
* **greedy text**: every greedy answer that ended ``ok`` reads as without
  faults (:mod:`frontend.drill.greedy`); the verdict is *not checked* — neither
  passed nor failed — when no answer could be compared;
* **latency** of the requests sent before, during and after the fault;
  **recovery**: the first request sent after the fault that completed, and the
  first dispatch decision the log shows after it;
* **blocks**: once the load stopped, every live agent answers its ``stats`` RPC
  with no request, no used and no reserved block;
* **log**: the events stream folds from its first position without a
  position error (:func:`scheduler.replay.replay_log`), and its sequence has
  no gap; every migration in it has exactly one outcome: one claim on its
  ``.outcome`` subject (commit or abort, first claim wins), or — for one that
  ended before any commit was sent, which claims nothing — an ``Abort``;
* **recompute**: rescues (the frontend's counter) and preemptions (agents' reports);
* **the bound**: no request hangs: each ends, and one that ends with an error does so within the
  frontend's bound on a request no instance can take, plus a margin, of when it was sent or the
  fault struck (whichever was later);
* **readiness**: no request ends with an error the frontend answered (or is lost) while an
  instance had been ready for a grace period and still was (it could have taken it), from the
  instances' lifecycle the drill saw on the bus and the kills it made; and the log shows no
  request placed (``RequestPlaced``, ``Dispatched``, ``RequestRescued``) on an instance that had
  not announced itself ready (``InstanceJoined``), or that had failed or left since;
* **prefix index** (``expect_prefix_index``): each dispatch that recorded the scheduler's prefix
  index (``Dispatched.cached_blocks`` at ``kv_seq``) matches the index folded from the
  ``<prefix>_kv`` stream up to that sequence (:func:`scheduler.prefix_index.replay_index`) for the
  request's chain, rebuilt from its prompt with the frontend's tokenizer: a scheduler that took
  over (the standby, a restarted one) reads the same index as the one it replaced; and the share
  of prompt tokens the agents served from their prefix caches (``usage.prompt_tokens_details.
  cached_tokens``) after the fault is no lower than before it, within a margin.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from frontend.drill.faults import FaultRecord
from frontend.drill.load import Outcome, RequestRecord
from frontend.drill.scenario import Scenario
from frontend.drill.watch import BusWatch
from schemas.decisions import Dispatched
from schemas.instance import InstanceFailed, InstanceJoined, InstanceLeft
from schemas.load import LoadReport
from schemas.requests import RequestPlaced, RequestRescued

__all__ = [
    "AgentCheck",
    "LogCheck",
    "PrefixCheck",
    "Verdict",
    "check_agents",
    "check_log",
    "check_placements",
    "check_prefix_index",
    "compare_prefix_views",
    "greedy_verdict",
    "hang_verdict",
    "hanging",
    "hit_rate",
    "hit_rate_verdict",
    "judge",
    "latency_summary",
    "placement_verdict",
    "prefix_index_verdict",
    "ready_intervals",
    "rescues",
    "takeable_verdict",
]


@dataclass
class AgentCheck:
    instance_id: str
    answered: bool
    num_requests: int = 0
    num_used_blocks: int = 0
    num_reserved_blocks: int = 0
    num_preemptions: int = 0


@dataclass
class LogCheck:
    num_events: int = 0
    first_seq: int = 0
    last_seq: int = 0
    gaps: list[str] = field(default_factory=list)
    fold_error: str | None = None
    num_migrations: int = 0
    committed: int = 0
    aborted: int = 0
    without_outcome: list[str] = field(default_factory=list)
    several_outcomes: list[str] = field(default_factory=list)
    abort_reasons: dict[str, int] = field(default_factory=dict)
    #: placements in the log (``RequestPlaced``, ``Dispatched``, ``RequestRescued``) and those on an
    #: instance that was not ready then (never announced ``InstanceJoined``, or failed or left since)
    num_placements: int = 0
    num_placed_not_ready: int = 0
    placed_not_ready: list[str] = field(default_factory=list)
    #: per instance: how often it announced itself ready, how many placements named it
    joins: dict[str, int] = field(default_factory=dict)
    placements: dict[str, int] = field(default_factory=dict)

    @property
    def folds(self) -> bool:
        return self.fold_error is None and not self.gaps


@dataclass
class PrefixCheck:
    """The scheduler's prefix index as its dispatches recorded it, against the cache events' fold."""

    #: batches in the ``<prefix>_kv`` stream, and the block size they name
    kv_batches: int = 0
    block_size: int = 0
    #: ``Dispatched`` events, and those that recorded the index (``kv_seq`` > 0)
    dispatches: int = 0
    with_view: int = 0
    #: of those, compared with the fold (per scheduler epoch), and those that differ
    compared: dict[int, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    num_mismatches: int = 0
    #: dispatches whose chain the drill could not rebuild (request unknown, or its chain shorter)
    no_chain: int = 0
    #: blocks of the chains compared, and of those held by the instance holding the most
    chain_blocks: int = 0
    held_blocks: int = 0
    error: str | None = None


@dataclass
class Verdict:
    """One verdict: ``passed`` only if it was checked and held; one not checked fails nothing."""

    name: str
    passed: bool
    detail: str
    checked: bool = True

    @property
    def status(self) -> str:
        """``passed``, ``failed`` or ``not checked``."""
        if not self.checked:
            return "not checked"
        return "passed" if self.passed else "failed"

    @property
    def failed(self) -> bool:
        return self.checked and not self.passed


def greedy_verdict(records: Sequence[RequestRecord], method: str | None) -> Verdict:
    """Greedy answers compared with their no-fault text; ``method`` None: no comparison possible here."""
    name = "greedy text as without faults"
    greedy = [r for r in records if r.greedy and r.index >= 0]
    compared = [r for r in greedy if r.compared_chars is not None]
    mismatches = sum(1 for r in compared if r.outcome is Outcome.MISMATCH)
    chars = sum(r.compared_chars or 0 for r in compared)
    if method is None:
        return Verdict(name, False, "not checked: the no-fault text of this cluster's answers is unknown "
                       "(sim agents the drill did not start)", checked=False)
    if not compared or not chars:
        return Verdict(name, False, f"not checked: {len(greedy)} greedy requests, {len(compared)} compared, "
                       f"{chars} characters to compare", checked=False)
    return Verdict(name, mismatches == 0, f"{mismatches} of {len(compared)} greedy answers differ "
                   f"({chars} characters compared; {len(greedy)} greedy requests); with {method}")


def hang_verdict(
    records: Sequence[RequestRecord], faults: Sequence[FaultRecord], bound_s: float | None, margin_s: float
) -> Verdict:
    """Every request ended; one that ended with an error did so within ``bound_s`` + ``margin_s`` of
    when it was sent or the last fault before its end struck, whichever was later."""
    name = "no request hanging past the bound"
    sent = [r for r in records if r.index >= 0]
    if bound_s is None:
        return Verdict(name, False, "not checked: the frontend's bound on a request no instance can take "
                       "is unknown", checked=False)
    if not sent:
        return Verdict(name, False, "not checked: no request was sent", checked=False)
    limit = bound_s + margin_s
    hung = [r for r in sent if r.timed_out or r.ended_at is None]
    waits = _error_waits(sent, faults)
    late = [(w, r) for w, r in waits if w > limit]
    detail = (f"{len(hung)} of {len(sent)} requests without an end; {len(late)} of {len(waits)} errors "
              f"ended more than {limit:g}s (bound {bound_s:g}s + margin {margin_s:g}s) after they were "
              "sent or the fault struck")
    if waits:
        detail += f"; the longest {max(w for w, _ in waits):.2f}s"
    examples = [f"#{r.index} {r.detail[:60]}" for r in hung[:2]] + [f"#{r.index} after {w:.1f}s"
                                                                   for w, r in late[:2]]
    if examples:
        detail += f" ({'; '.join(examples)})"
    return Verdict(name, not hung and not late, detail)


def _error_waits(
    records: Sequence[RequestRecord], faults: Sequence[FaultRecord]
) -> list[tuple[float, RequestRecord]]:
    """For each request that ended with an error: how long after it was sent, or after the last
    fault before its end struck (whichever was later), it ended."""
    struck = sorted(f.injected_at for f in faults if f.injected_at is not None)
    waits = []
    for record in records:
        if record.outcome is Outcome.ERROR and record.ended_at is not None and record.index >= 0:
            end = record.ended_at
            waits.append((end - max([record.sent_at, *(t for t in struck if t <= end)]), record))
    return waits


def hanging(
    records: Sequence[RequestRecord], faults: Sequence[FaultRecord], bound_s: float | None, margin_s: float
) -> int | None:
    """Requests that hung: no end, or an error past ``bound_s`` + ``margin_s`` (None: bound unknown)."""
    if bound_s is None:
        return None
    sent = [r for r in records if r.index >= 0]
    late = sum(1 for w, _ in _error_waits(sent, faults) if w > bound_s + margin_s)
    return late + sum(1 for r in sent if r.timed_out or r.ended_at is None)


def ready_intervals(
    lifecycle: Sequence[tuple[float, str, str]], kills: Sequence[tuple[float, str]], until: float
) -> dict[str, list[tuple[float, float]]]:
    """Per instance, the spans (drill time) it was ready: from its ``joined`` to its ``failed`` or
    ``left``, or the drill's kill of its process, whichever came first; ``until`` ends an open span."""
    events = sorted([*lifecycle, *((t, i, "killed") for t, i in kills)])
    spans: dict[str, list[tuple[float, float]]] = {}
    opened: dict[str, float] = {}
    for time_s, instance_id, kind in events:
        if kind == "joined":
            opened.setdefault(instance_id, time_s)
        elif instance_id in opened:
            spans.setdefault(instance_id, []).append((opened.pop(instance_id), time_s))
    for instance_id, since in opened.items():
        spans.setdefault(instance_id, []).append((since, until))
    return spans


def takeable_verdict(
    records: Sequence[RequestRecord],
    ready: Mapping[str, Sequence[tuple[float, float]]] | None,
    grace_s: float,
    frontend_down: Sequence[tuple[float, float]] = (),
) -> Verdict:
    """No request ended with an error or was lost while an instance could have taken it: one ready
    for ``grace_s`` or more before the request ended and still ready then. Ends while the frontend
    was down (``frontend_down``: its kill until it answered again) are the frontend's fault's."""
    name = "none lost where an instance could take it"
    if ready is None:
        return Verdict(name, False, "not checked: the instances' readiness was not followed", checked=False)
    latest = max((b for spans in ready.values() for _, b in spans), default=0.0)
    failed = [r for r in records if r.index >= 0 and r.outcome in (Outcome.ERROR, Outcome.LOST)]
    takeable: list[tuple[RequestRecord, str]] = []
    for record in failed:
        end = record.ended_at if record.ended_at is not None else latest
        if any(a <= end <= b for a, b in frontend_down):
            continue
        by = sorted(i for i, spans in ready.items() if any(a <= end - grace_s and end <= b for a, b in spans))
        if by:
            takeable.append((record, by[0]))
    detail = (f"{len(takeable)} of {len(failed)} errors and losses ended while an instance had been ready "
              f"for {grace_s:g}s or more")
    if takeable:
        detail += " (" + "; ".join(f"#{r.index} at {r.ended_at or latest:.1f}s, {i} ready: {r.detail[:60]}"
                                   for r, i in takeable[:3]) + ")"
    return Verdict(name, not takeable, detail)


def _kills_of(fault: FaultRecord, faults: Sequence[FaultRecord]) -> str:
    kills = sum(f.component == fault.component and f.kind == "crash_loop" for f in faults)
    return f"killed {kills} times; " if kills else ""


def _back(fault: FaultRecord) -> str:
    if fault.back_at is None or fault.injected_at is None:
        return "not back"
    return f"ready again {fault.back_at - fault.injected_at:.1f}s after the kill"


def _frontend_down(faults: Sequence[FaultRecord]) -> list[tuple[float, float]]:
    """The spans the frontend was down: from its fault until it answered again (never: to the end)."""
    return [(f.injected_at, f.back_at if f.back_at is not None else float("inf"))
            for f in faults if f.component == "frontend" and f.injected_at is not None]


def hit_rate(records: Sequence[RequestRecord]) -> tuple[float | None, int]:
    """Cached prompt tokens over prompt tokens of the ``ok`` answers that said both, and how many
    answers that is (None: none said)."""
    said = [r for r in records if r.outcome is Outcome.OK and r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in said)
    return (sum(r.cached_tokens or 0 for r in said) / prompt if prompt else None), len(said)


def hit_rate_verdict(
    records: Sequence[RequestRecord], fault_at: float | None, after_s: float | None, margin: float
) -> Verdict:
    """The prefix-cache hit rate of the requests sent after ``after_s`` is at least that of those
    sent before the fault (``fault_at``), less ``margin``."""
    name = "prefix-cache hit rate held after the fault"
    sent = [r for r in records if r.index >= 0]
    if fault_at is None or after_s is None:
        return Verdict(name, False, "not checked: no fault struck", checked=False)
    before, num_before = hit_rate([r for r in sent if r.sent_at < fault_at])
    after, num_after = hit_rate([r for r in sent if r.sent_at >= after_s])
    if before is None or after is None:
        return Verdict(name, False, f"not checked: {num_before} answers before the fault and {num_after} "
                       "after said their cached tokens (usage.prompt_tokens_details.cached_tokens)",
                       checked=False)
    return Verdict(name, after >= before - margin,
                   f"{100 * after:.1f}% of prompt tokens cached after the fault ({num_after} answers), "
                   f"{100 * before:.1f}% before ({num_before}); margin {100 * margin:.0f} points")


def compare_prefix_views(
    check: PrefixCheck,
    dispatches: Sequence[tuple[int, Any]],
    batches: Sequence[tuple[int, Any]],
    chains: Mapping[str, Sequence[int]],
) -> None:
    """Fill ``check``: each dispatch ``(log seq, Dispatched)`` that recorded the prefix index, against
    :func:`~scheduler.prefix_index.replay_index` of the ``(kv seq, KVCacheEvents)`` ``batches`` up to its
    ``kv_seq``, for the request's chain in ``chains`` (by request id), the instances holding most of it
    kept as the scheduler keeps them (``PREFIX_HITS_KEPT``)."""
    from scheduler.prefix_index import PrefixIndex
    from scheduler.service import PREFIX_HITS_KEPT

    check.kv_batches = len(batches)
    check.block_size = next((b.block_size for _, b in batches), 0)
    check.dispatches = len(dispatches)
    viewed = sorted(((d.kv_seq, seq, d) for seq, d in dispatches if d.kv_seq > 0), key=lambda v: (v[0], v[1]))
    check.with_view = len(viewed)
    index = PrefixIndex()
    position = 0
    for kv_seq, seq, dispatched in viewed:
        while position < len(batches) and batches[position][0] <= kv_seq:
            index.apply(batches[position][1], batches[position][0])
            position += 1
        chain = chains.get(dispatched.request_id)
        if chain is None or len(chain) < dispatched.num_chain_blocks:
            check.no_chain += 1
            continue
        expected = index.overlap(chain[: dispatched.num_chain_blocks], block_size=check.block_size,
                                 limit=PREFIX_HITS_KEPT)
        recorded = dict(dispatched.cached_blocks)
        check.compared[dispatched.epoch] = check.compared.get(dispatched.epoch, 0) + 1
        check.chain_blocks += dispatched.num_chain_blocks
        check.held_blocks += max(expected.values(), default=0)
        if recorded != expected:
            check.num_mismatches += 1
            if len(check.mismatches) < 5:
                check.mismatches.append(f"{dispatched.request_id} (log seq {seq}, epoch {dispatched.epoch}, "
                                        f"kv seq {kv_seq}): recorded {recorded}, the fold says {expected}")


async def check_prefix_index(
    nats_url: str, prefix: str, records: Sequence[RequestRecord], model: str
) -> PrefixCheck:
    """:func:`compare_prefix_views` on the cluster's log and ``<prefix>_kv`` stream, each request's
    chain rebuilt from its prompt (:func:`schemas.block_hash.block_hashes` of the frontend's tokens)."""
    from bus import BusConfig, JetStreamBus, NatsAuth
    from frontend.tokenization import completion_prompt_ids, load_frontend_tokenizer
    from scheduler.events_cli import read_live
    from schemas import Codec, Subjects
    from schemas.block_hash import block_hashes
    from schemas.kv_events import KVCacheEvents

    check = PrefixCheck()
    codec = Codec()
    try:
        log = await read_live(nats_url, prefix, None, None)
        dispatches = []
        for entry in log.events:
            envelope = codec.decode_or_none(entry.data)
            if envelope is not None and isinstance(envelope.body, Dispatched):
                dispatches.append((entry.seq, envelope.body))
        batches: list[tuple[int, KVCacheEvents]] = []
        config = BusConfig(url=nats_url, auth=NatsAuth(), subjects=Subjects(prefix), name="shoal-drill-kv",
                           provision=False)
        async with JetStreamBus(config) as bus:
            async with bus.replay(bus.config.subjects.kv_stream) as feed:
                async for message in feed:
                    envelope = codec.decode_or_none(message.data)
                    if envelope is not None and isinstance(envelope.body, KVCacheEvents):
                        batches.append((message.position.seq, envelope.body))
    except Exception as exc:  # the verdict says it could not be checked, and why
        check.error = f"{type(exc).__name__}: {exc}"
        return check
    block_size = next((b.block_size for _, b in batches), 0)
    chains: dict[str, list[int]] = {}
    if block_size:
        tokenizer = load_frontend_tokenizer(model)
        for record in records:
            if record.request_id and record.prompt:
                ids = completion_prompt_ids(tokenizer, record.prompt)[0]
                chains[record.request_id] = block_hashes(ids, block_size)
    compare_prefix_views(check, dispatches, batches, chains)
    return check


def prefix_index_verdict(check: PrefixCheck | None) -> Verdict:
    """Every compared dispatch's recorded prefix view equals the cache events' fold, with dispatches
    of two scheduler epochs at least compared (the one the fault ended and the one after it)."""
    name = "scheduler's prefix index equals the cache events' fold"
    if check is None:
        return Verdict(name, False, "not checked: the prefix index was not read", checked=False)
    if check.error is not None:
        return Verdict(name, False, f"not checked: {check.error}", checked=False)
    epochs = ", ".join(f"epoch {e}: {n}" for e, n in sorted(check.compared.items()))
    detail = (f"{check.num_mismatches} of {sum(check.compared.values())} dispatches differ "
              f"({epochs or 'none'}; "
              f"{check.with_view} of {check.dispatches} dispatches recorded the index, {check.no_chain} "
              f"without a chain; {check.kv_batches} cache-event batches; the best instance held "
              f"{check.held_blocks} of the {check.chain_blocks} blocks of the chains)")
    if check.mismatches:
        detail += ": " + "; ".join(check.mismatches[:2])
    if check.num_mismatches:
        return Verdict(name, False, detail)
    if len(check.compared) < 2:
        return Verdict(name, False, "not checked: dispatches of fewer than two scheduler epochs compared; "
                       + detail, checked=False)
    return Verdict(name, True, detail)


def placement_verdict(log: LogCheck) -> Verdict:
    """The log places no request on an instance that was not ready (never joined, failed or left)."""
    name = "never dispatched to an instance not ready"
    if not log.num_placements:
        return Verdict(name, False, "not checked: the log holds no placement", checked=False)
    detail = f"{log.num_placed_not_ready} of {log.num_placements} placements on an instance not ready"
    if log.placed_not_ready:
        detail += f": {log.placed_not_ready[:3]}"
    return Verdict(name, log.num_placed_not_ready == 0, detail)


#: Abort reasons that say the request ended, not that the fault stopped the migration.
_REQUEST_ENDED = frozenset({"request_finished", "request_preempted", "request_aborted"})


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r.latency_s for r in records if r.outcome is Outcome.OK and r.latency_s is not None]
    ttft = [
        r.first_token_at - r.sent_at
        for r in records
        if r.outcome is Outcome.OK and r.stream and r.first_token_at is not None
    ]
    return {
        "requests": len(records),
        "ok": len(ok),
        "p50_s": _percentile(ok, 0.5),
        "p99_s": _percentile(ok, 0.99),
        "mean_s": statistics.fmean(ok) if ok else None,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p99_s": _percentile(ttft, 0.99),
    }


async def check_agents(watch: BusWatch, instance_ids: Sequence[str], settle_s: float) -> list[AgentCheck]:
    """Ask each agent for its usage until none holds anything, or ``settle_s`` passed; the last answers."""
    deadline = time.monotonic() + settle_s
    while True:
        checks = []
        for instance_id in instance_ids:
            report = await watch.stats(instance_id, 2.0)
            checks.append(_agent_check(instance_id, report))
        clean = all(
            c.answered and not (c.num_requests or c.num_used_blocks or c.num_reserved_blocks) for c in checks
        )
        if clean or time.monotonic() > deadline:
            return checks
        await asyncio.sleep(0.5)


def _agent_check(instance_id: str, report: LoadReport | None) -> AgentCheck:
    if report is None:
        return AgentCheck(instance_id, answered=False)
    return AgentCheck(
        instance_id,
        True,
        num_requests=report.batch_size + report.num_waiting,
        num_used_blocks=report.num_total_blocks - report.num_free_blocks,
        num_reserved_blocks=report.num_reserved_blocks,
        num_preemptions=report.num_preemptions,
    )


async def check_log(nats_url: str, prefix: str, settle_s: float) -> LogCheck:
    """Read the whole log; retry while a migration has no outcome yet (its peer's timeout runs)."""
    deadline = time.monotonic() + settle_s
    while True:
        check = await _read_log(nats_url, prefix)
        if not check.without_outcome or time.monotonic() > deadline:
            return check
        await asyncio.sleep(1.0)


async def _read_log(nats_url: str, prefix: str) -> LogCheck:
    from scheduler.events_cli import read_live
    from scheduler.fold import FoldError
    from scheduler.replay import replay_log
    from schemas import Codec
    from schemas.migration import Abort, CommitAck, PreAllocate

    log = await read_live(nats_url, prefix, None, None)
    check = LogCheck(num_events=len(log.events))
    seqs = [e.seq for e in log.events]
    if seqs:
        check.first_seq, check.last_seq = seqs[0], seqs[-1]
        check.gaps = [f"{a} -> {b}" for a, b in itertools.pairwise(seqs) if b != a + 1][:10]
        if seqs[0] != 1:
            check.gaps.insert(0, f"starts at {seqs[0]}")
    try:
        replay_log(log)
    except FoldError as exc:
        check.fold_error = f"{type(exc).__name__}: {exc}"
    codec = Codec()
    started: set[str] = set()
    claims: dict[str, list[str]] = {}  # the first-claim-wins outcomes on ``<mig>.outcome``
    aborts: dict[str, str] = {}  # an Abort on the migration's own subject (before any commit: no claim)
    bodies: list[tuple[int, object]] = []
    for entry in log.events:
        envelope = codec.decode_or_none(entry.data)
        body = None if envelope is None else envelope.body
        bodies.append((entry.seq, body))
        if isinstance(body, PreAllocate):
            started.add(body.migration_id)
        elif entry.subject.endswith(".outcome") and isinstance(body, CommitAck | Abort):
            claims.setdefault(body.migration_id, []).append(
                "committed" if isinstance(body, CommitAck) else str(body.reason)
            )
        elif isinstance(body, Abort):
            aborts.setdefault(body.migration_id, str(body.reason))
    check_placements(check, bodies)
    check.num_migrations = len(started)
    for migration_id in sorted(started):
        claimed = claims.get(migration_id, [])
        if len(claimed) > 1:
            check.several_outcomes.append(migration_id)
            continue
        outcome = claimed[0] if claimed else aborts.get(migration_id)
        if outcome is None:
            check.without_outcome.append(migration_id)
        elif outcome == "committed":
            check.committed += 1
        else:
            check.aborted += 1
            check.abort_reasons[outcome] = check.abort_reasons.get(outcome, 0) + 1
    return check


def check_placements(check: LogCheck, events: Sequence[tuple[int, object]]) -> None:
    """Fill ``check``'s placements from the log's (seq, body) in order: each placement on an
    instance that had not announced itself ready (``InstanceJoined``), or had failed or left since,
    is one on an instance not ready. A failure of an earlier incarnation (``InstanceFailed``'s
    ``incarnation``: the seq of the ``InstanceJoined`` it concerns) leaves the current one ready."""
    state: dict[str, str] = {}  # instance -> "ready" | "failed" | "left" (absent: never ready)
    incarnation: dict[str, int] = {}  # instance -> the seq of its current InstanceJoined
    for seq, body in events:
        placed = _placement(body)
        if isinstance(body, InstanceJoined):
            state[body.instance_id] = "ready"
            incarnation[body.instance_id] = seq
            check.joins[body.instance_id] = check.joins.get(body.instance_id, 0) + 1
        elif isinstance(body, InstanceFailed | InstanceLeft):
            earlier = isinstance(body, InstanceFailed) and body.incarnation not in (
                0, incarnation.get(body.instance_id))  # about an incarnation before the current one
            if body.instance_id in state and not earlier:
                state[body.instance_id] = "failed" if isinstance(body, InstanceFailed) else "left"
        elif placed is not None:
            request_id, instance_id, what = placed
            check.num_placements += 1
            check.placements[instance_id] = check.placements.get(instance_id, 0) + 1
            status = state.get(instance_id, "never ready")
            if status != "ready":
                check.num_placed_not_ready += 1
                if len(check.placed_not_ready) < 10:
                    check.placed_not_ready.append(
                        f"{what} {request_id} on {instance_id} ({status}, seq {seq})")


def _placement(body: object) -> tuple[str, str, str] | None:
    """(request id, instance id, what) when ``body`` places a request on an instance."""
    if isinstance(body, RequestPlaced):
        return body.request_id, body.instance_id, "placed"
    if isinstance(body, Dispatched):
        return body.request_id, body.instance_id, "dispatched"
    if isinstance(body, RequestRescued):
        return body.request_id, body.new_instance_id, "rescued"
    return None


async def rescues(url: str) -> float | None:
    """The frontend's ``shoal_rescues_total`` (all causes); None when it does not answer."""
    try:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{url}/metrics", timeout=3.0)).text
    except httpx.HTTPError:
        return None
    return sum(float(v) for v in re.findall(r"^shoal_rescues_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def judge(
    scenario: Scenario,
    records: Sequence[RequestRecord],
    faults: Sequence[FaultRecord],
    agents: Sequence[AgentCheck],
    log: LogCheck,
    *,
    recovered: bool,
    num_rescues: float | None,
    num_preemptions: int,
    greedy_method: str | None,
    bound_s: float | None = None,
    ready: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    prefix: PrefixCheck | None = None,
    recovery_start: float | None = None,
) -> list[Verdict]:
    """The scenario's verdicts. ``bound_s``: the frontend's bound on a request no instance can take
    (None: unknown); ``ready``: each instance's spans of readiness (:func:`ready_intervals`; None:
    not followed); ``prefix``: the prefix index check (``expect_prefix_index``), and
    ``recovery_start``: when the requests whose hit rate is compared with the steady load's start."""
    counts = {o: sum(1 for r in records if r.outcome is o) for o in Outcome}
    expect = scenario.verdicts
    verdicts = [
        Verdict(
            "fault verified",
            all(f.verified for f in faults),
            "; ".join(f"{f.kind} {f.component}: {f.verified_by}" for f in faults) or "no fault",
        ),
        Verdict(
            "no request lost",
            counts[Outcome.LOST] == 0 and counts[Outcome.PENDING] == 0,
            f"{counts[Outcome.LOST]} lost, {counts[Outcome.OK]} ok, {counts[Outcome.ERROR]} clean errors",
        ),
        Verdict(
            "no request rejected",
            counts[Outcome.REJECTED] == 0,
            f"{counts[Outcome.REJECTED]} rejected with a client error (does the load fit the model?)",
        ),
        greedy_verdict(records, greedy_method),
        hang_verdict(records, faults, bound_s, expect.hang_margin_s),
        takeable_verdict(records, ready, expect.ready_grace_s, _frontend_down(faults)),
        Verdict(
            "no block leaked",
            all(
                a.answered and not (a.num_used_blocks or a.num_reserved_blocks or a.num_requests)
                for a in agents
            ),
            ", ".join(
                f"{a.instance_id}: "
                + (
                    f"{a.num_requests} req, {a.num_used_blocks} used, {a.num_reserved_blocks} reserved"
                    if a.answered
                    else "no answer"
                )
                for a in agents
            ),
        ),
        Verdict(
            "log folds from the start",
            log.folds,
            log.fold_error
            or (
                f"gaps {log.gaps}"
                if log.gaps
                else f"{log.num_events} events, seq {log.first_seq}..{log.last_seq}"
            ),
        ),
        Verdict(
            "one outcome per migration",
            not log.without_outcome and not log.several_outcomes,
            f"{log.num_migrations} migrations: {log.committed} committed, {log.aborted} aborted"
            + (f", no outcome: {log.without_outcome[:3]}" if log.without_outcome else "")
            + (f", several: {log.several_outcomes[:3]}" if log.several_outcomes else ""),
        ),
    ]
    verdicts.append(placement_verdict(log))
    faulty = scenario.cluster.faulty_agent_ids
    if faulty:
        verdicts.append(Verdict(
            "an engine that cannot step: never ready, never given a request",
            not any(log.joins.get(i) or log.placements.get(i) for i in faulty),
            ", ".join(f"{i} ({scenario.cluster.first_step_faults[int(i.split('-')[1])]}): announced ready "
                      f"{log.joins.get(i, 0)} times, {log.placements.get(i, 0)} placements" for i in faulty)))
    if expect.expect_supervised_return:
        killed = [f for f in faults if f.component.startswith("agent")]
        verdicts.append(Verdict(
            "killed agents came back by supervision",
            bool(killed) and all(f.back_at is not None for f in killed),
            "; ".join(f"{f.component} " + _back(f) for f in killed) or "no agent killed"))
    if expect.expect_left_down:
        looped = [f for f in faults if f.left_down is not None]  # a crash loop's last kill, each first-step
        verdicts.append(Verdict(
            "left down after crash-looping",
            bool(looped) and all(f.left_down for f in looped),
            "; ".join(_kills_of(f, faults) + (f.left_down_reason or f"{f.component} not left down")
                      for f in looped) or "no crash loop"))
    acked = [f.events_acked for f in faults if f.events_acked is not None]
    if acked:
        verdicts.append(Verdict("no acknowledged event lost", log.last_seq >= max(acked) and log.folds,
                                f"{max(acked)} events acknowledged before the fault, "
                                f"{log.last_seq} in the log after it"))
    if expect.expect_recovery:
        verdicts.append(Verdict("recovered", recovered, "a request sent after the fault completed"
                                if recovered else "no request sent after the fault completed"))
    if expect.max_orphan_s is not None:
        held = [(f.requests_on_agents, f.agents_empty_after_s) for f in faults]
        verdicts.append(Verdict(
            "agents dropped the dead frontend's requests",
            bool(held) and all(n and s is not None and s <= expect.max_orphan_s for n, s in held),
            "; ".join(f"{n} requests on agents at the kill, none after "
                      + ("never" if s is None else f"{s:.2f}s") for n, s in held)))
    if expect.expect_errors:
        verdicts.append(
            Verdict(
                "clients saw clean errors", counts[Outcome.ERROR] > 0, f"{counts[Outcome.ERROR]} clean errors"
            )
        )
    if expect.max_errors is not None:
        verdicts.append(
            Verdict(
                "errors within bound",
                counts[Outcome.ERROR] <= expect.max_errors,
                f"{counts[Outcome.ERROR]} <= {expect.max_errors}",
            )
        )
    if expect.expect_migration_abort:
        by_fault = {r: n for r, n in log.abort_reasons.items() if r not in _REQUEST_ENDED}
        ended = {r: n for r, n in log.abort_reasons.items() if r in _REQUEST_ENDED}
        detail = f"aborts: {by_fault or 'none'}"
        if ended:
            detail += f"; not counted, the request ended first: {ended}"
        verdicts.append(Verdict("a migration aborted by the fault", bool(by_fault), detail))
    if expect.expect_migration_commit:
        verdicts.append(Verdict("a migration committed", log.committed > 0, f"{log.committed} committed"))
    if expect.expect_rescue:
        verdicts.append(Verdict("the killed agent's requests were rescued", bool(num_rescues),
                                f"{num_rescues} rescues; the agent held "
                                + ", ".join(str(f.target_requests) for f in faults) + " requests"))
    if expect.expect_prefix_index:
        struck = next((f.injected_at for f in faults if f.injected_at is not None), None)
        verdicts.append(prefix_index_verdict(prefix))
        verdicts.append(hit_rate_verdict(records, struck, recovery_start, expect.hit_rate_margin))
    if expect.expect_no_recompute:
        verdicts.append(
            Verdict(
                "nothing recomputed",
                num_rescues == 0 and num_preemptions == 0,
                f"{num_rescues} rescues, {num_preemptions} preemptions",
            )
        )
    return verdicts
