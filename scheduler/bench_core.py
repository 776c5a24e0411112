"""Micro-benchmarks of the pure policy core: fold throughput, dispatch and pairing latency.

Run ``python -m scheduler.bench_core [--events N] [--instances K]``. It builds a
synthetic log shaped like a busy cluster (mostly load reports, then
dispatches, request lifecycle and migration steps), folds it with
:func:`scheduler.fold.replay`, and times each dispatch policy (a new dispatcher
per call: every instance scored) and pairing over ``K`` instance views, and
the live scheduler's dispatch path (``dispatch_live_*``: between two dispatches
one new load report is folded, then :func:`scheduler.recompute.dispatch_decision`
decides and its event is overlaid, as the service does) with one dispatcher kept
across decisions, as the service keeps it (``kept``: only changed views are
rated again), and with a new one per decision (``fresh``), alternating. Times are CPU seconds of this process
(``time.process_time``), so other work on a shared machine does not inflate
them. Prints one JSON object. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from scheduler.cluster_state import ClusterState, encode_snapshot, initial_state, live_loads
from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.fold import evolve, replay
from scheduler.policy import PendingRequest, make_dispatcher, pair_instances
from scheduler.recompute import Cursor, apply_overlay, dispatch_decision
from schemas.decisions import Dispatched
from schemas.envelope import Body
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad
from schemas.migration import Ack, CommitAck, PreAllocate, StageDone
from schemas.position import Position
from schemas.reasons import FinishReason
from schemas.requests import RequestArrived, RequestFinished
from schemas.rpc import DispatchRequest

__all__ = ["build_log", "main"]

EVENTS, LOADS = "bench_events", "bench_loads"


def build_log(num_events: int, num_instances: int, seed: int = 0) -> list[tuple[Position, Body]]:
    """A synthetic two-stream log: joins first, then a busy mix of events."""
    rng = random.Random(seed)
    seq = {EVENTS: 0, LOADS: 0}
    log: list[tuple[Position, Body]] = []

    def add(body: Body, stream: str = EVENTS) -> None:
        seq[stream] += 1
        log.append((Position(stream, seq[stream]), body))

    layout = KVLayout(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype="float16")
    ids = [f"inst-{k:03d}" for k in range(num_instances)]
    for iid in ids:
        add(InstanceJoined(instance_id=iid, num_blocks=851, block_size=16, model=ModelIdentity(model_id="m"),
                           kv_layout=layout, transport_address=f"tcp://{iid}"))
    report_seq = dict.fromkeys(ids, 0)
    accepted = dict.fromkeys(ids, 0)
    request = 0
    while len(log) < num_events:
        roll = rng.random()
        iid = rng.choice(ids)
        if roll < 0.6:
            report_seq[iid] += 1
            accepted[iid] += rng.randint(0, 2)
            running = rng.randint(0, 30)
            add(LoadReport(
                instance_id=iid, seq=report_seq[iid], num_total_blocks=851, num_free_blocks=400,
                num_reserved_blocks=0,
                running=(PriorityLoad(priority=0, num_running=running, num_blocks=running * 15),),
                head_of_line_demand=rng.choice((0, 0, 0, 40)), num_waiting=rng.randint(0, 3),
                batch_size=running, freeness=0.0, virtual_usage=0.0, num_accepted=accepted[iid],
            ), LOADS)
        elif roll < 0.75:
            request += 1
            add(Dispatched(epoch=1, request_id=f"r{request}", instance_id=iid, policy="freeness",
                           num_prompt_tokens=rng.randint(10, 2000)))
        elif roll < 0.9:
            add(RequestArrived(request_id=f"r{request}", num_prompt_tokens=100, max_tokens=100))
            add(RequestFinished(request_id=f"r{max(request - 50, 0)}", finish_reason=FinishReason.STOP,
                                num_prompt_tokens=100, num_output_tokens=100, e2e_s=1.0))
        else:
            mid = f"m{request}-{len(log)}"
            add(PreAllocate(migration_id=mid, request_id=f"r{request}", source_id=iid, destination_id=ids[0],
                            stage=0, num_blocks=30))
            add(Ack(migration_id=mid, stage=0, block_ids=tuple(range(30))))
            add(StageDone(migration_id=mid, stage=0, num_blocks=30, num_bytes=1 << 20, duration_s=0.01))
            add(CommitAck(migration_id=mid, request_id=f"r{request}", destination_id=ids[0], owner_epoch=1,
                          resumed_at=0.0))
    return log[:num_events]


def _time_per_call(fn: object, repeat: int) -> float:
    call = fn  # a zero-argument callable
    start = time.process_time()
    for _ in range(repeat):
        call()  # type: ignore[operator]
    return (time.process_time() - start) / repeat


def _live_dispatch_seconds(state: ClusterState, config: PolicyConfig, *, keep: bool, count: int) -> float:
    """CPU seconds per dispatch of the service's path: fold one report, decide, overlay the event."""
    rng = random.Random(7)
    kept = make_dispatcher(config.dispatch_policy, config)
    view = state
    loads_seq = state.positions.get(LOADS, 0)
    reports = {iid: record.load for iid, record in state.instances.items()}
    ids = sorted(reports)
    start = time.process_time()
    for number in range(count):
        iid = rng.choice(ids)
        previous = reports[iid]
        loads_seq += 1
        running = rng.randint(0, 30)
        report = LoadReport(
            instance_id=iid,
            seq=previous.report_seq + number + 1,
            num_total_blocks=851,
            num_free_blocks=400,
            num_reserved_blocks=0,
            running=(PriorityLoad(priority=0, num_running=running, num_blocks=running * 15),),
            head_of_line_demand=0,
            num_waiting=0,
            batch_size=running,
            freeness=0.0,
            virtual_usage=0.0,
            num_accepted=previous.num_accepted + number + 1,
        )
        view = evolve(view, Position(LOADS, loads_seq), report)
        request = DispatchRequest(request_id=f"live-{number}", num_prompt_tokens=128)
        event = dispatch_decision(
            view,
            request,
            epoch=1,
            cursor=Cursor(0, loads_seq),
            policy=config,
            dispatcher=kept if keep else make_dispatcher(config.dispatch_policy, config),
        )
        if event is not None:
            view = apply_overlay(view, (event,))
    return (time.process_time() - start) / count


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--instances", type=int, default=64)
    args = parser.parse_args(argv)
    log = build_log(args.events, args.instances)
    start = time.process_time()
    state = replay(log, initial_state(gapless_streams=(EVENTS,)))
    fold_s = time.process_time() - start
    results: dict[str, float] = {
        "events": float(len(log)),
        "fold_events_per_s": len(log) / fold_s,
        "snapshot_bytes": float(len(encode_snapshot(state))),
    }
    loads = live_loads(state)
    config = PolicyConfig()
    request = PendingRequest(request_id="x", num_prompt_tokens=700)
    for policy in DispatchPolicy:
        seconds = _time_per_call(
            lambda p=policy: make_dispatcher(p, config).choose(request, loads, num_dispatched=3), 2000
        )
        results[f"dispatch_{policy.value}_us"] = seconds * 1e6
    kept_s, fresh_s = [], []
    for _ in range(3):
        kept_s.append(_live_dispatch_seconds(state, config, keep=True, count=2000))
        fresh_s.append(_live_dispatch_seconds(state, config, keep=False, count=2000))
    results["dispatch_live_kept_us"] = statistics.median(kept_s) * 1e6
    results["dispatch_live_fresh_us"] = statistics.median(fresh_s) * 1e6
    pairings = list(state.pairings.values())
    results["pairing_us"] = _time_per_call(lambda: pair_instances(loads, pairings, config), 500) * 1e6
    print(json.dumps({k: round(v, 2) for k, v in results.items()}))
    return results


if __name__ == "__main__":
    main()
