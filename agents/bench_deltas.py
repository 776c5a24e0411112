"""``shoal bench deltas``: what one engine step's token deltas cost on the bus, per request vs batched.

An agent publishes, after every step, one delta per running request. Two ways
are compared on an embedded nats-server, in one process (publisher and
receiver share it, as the clients of ``shoal bench serve`` do; the variants
alternate ``--rounds`` times so both see the same background load):

* **per-request**: one :class:`~schemas.TokenDelta` message per request on its
  own subject (``tok.<request_id>``), one subscription per request on the
  receiving side — how deltas travel to a client that names no
  ``GenerateRequest.delta_subject``;
* **batched**: one :class:`~schemas.TokenDeltaBatch` per step on the frontend's
  subject (``tokb.<frontend_id>``), one subscription, routed to the requests by
  id — what a shoal frontend asks for.

Per step: the publisher's CPU time (encoding and publishing), the wall time
from the start of publishing until the receiver has every delta, and the
process CPU time (both sides). Medians over the steps of each round, then over rounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import click

from bus.bench_progress import BenchProgress
from bus.event_loop import wait_event

__all__ = ["bench_deltas", "measure_deltas"]


async def _run(url: str, requests: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    from bus import BusConfig, JetStreamBus
    from schemas import Codec, Subjects, TokenDelta, TokenDeltaBatch

    subjects = Subjects("benchdeltas")
    publisher = JetStreamBus(BusConfig(url=url, subjects=subjects, name="bench-agent"))
    receiver = JetStreamBus(BusConfig(url=url, subjects=subjects, name="bench-frontend"))
    await publisher.connect()
    await receiver.connect()
    codec, decoder = Codec("agent"), Codec("frontend")
    request_ids = [f"cmpl-{index:04d}-{os.getpid()}" for index in range(requests)]
    batch_subject = subjects.tok_batch("f1")
    received = 0
    all_in = asyncio.Event()

    def got(count: int) -> None:
        nonlocal received
        received += count
        if received >= requests:
            all_in.set()

    async def per_request_reader(subscription: Any) -> None:
        async for message in subscription:
            envelope = decoder.decode_or_none(message.data)
            if envelope is not None and isinstance(envelope.body, TokenDelta):
                got(1)

    async def batch_reader(subscription: Any) -> None:
        inboxes: dict[str, list[TokenDelta]] = {rid: [] for rid in request_ids}
        async for message in subscription:
            envelope = decoder.decode_or_none(message.data)
            if envelope is not None and isinstance(envelope.body, TokenDeltaBatch):
                for delta in envelope.body.deltas:
                    inbox = inboxes.get(delta.request_id)
                    if inbox is not None:
                        inbox.append(delta)
                got(len(envelope.body.deltas))

    def deltas(step: int) -> list[TokenDelta]:
        return [
            TokenDelta(
                request_id=rid,
                instance_id="a",
                owner_epoch=0,
                first_index=step,
                token_ids=(step % 300,),
                num_prompt_tokens=32,
            )
            for rid in request_ids
        ]

    async def publish_per_request(step: int) -> None:
        now = time.time()
        for delta in deltas(step):
            await publisher.publish(subjects.tok(delta.request_id), codec.encode(delta, time=now))

    async def publish_batch(step: int) -> None:
        batch = TokenDeltaBatch(instance_id="a", deltas=tuple(deltas(step)))
        await publisher.publish(batch_subject, codec.encode(batch, time=time.time()))

    async def one_round(variant: str) -> dict[str, float]:
        nonlocal received
        if variant == "per_request":
            subscriptions = [await receiver.subscribe(subjects.tok(rid)) for rid in request_ids]
            readers = [asyncio.create_task(per_request_reader(s)) for s in subscriptions]
            publish = publish_per_request
        else:
            subscriptions = [await receiver.subscribe(batch_subject)]
            readers = [asyncio.create_task(batch_reader(subscriptions[0]))]
            publish = publish_batch
        publish_cpu: list[float] = []
        delivered: list[float] = []
        incomplete = 0
        cpu_before = time.process_time()
        try:
            for step in range(steps):
                received = 0
                all_in.clear()
                started, thread_started = time.perf_counter(), time.thread_time()
                await publish(step)
                publish_cpu.append(time.thread_time() - thread_started)
                if not await wait_event(all_in, 2.0):  # a message lost (core NATS drops for slow consumers)
                    incomplete += 1
                    continue
                delivered.append(time.perf_counter() - started)
        finally:
            for reader in readers:
                reader.cancel()
            for subscription in subscriptions:
                await subscription.unsubscribe()
        return {
            "publish_cpu_us": 1e6 * statistics.median(publish_cpu),
            "delivered_us": 1e6 * statistics.median(delivered),
            "process_cpu_us_per_step": 1e6 * (time.process_time() - cpu_before) / steps,
            "incomplete_steps": float(incomplete),
        }

    rounds_out: dict[str, list[dict[str, float]]] = {"per_request": [], "batched": []}
    try:
        progress = BenchProgress("deltas", 2 * rounds)
        for index in range(rounds):
            for variant in ("per_request", "batched"):
                progress.phase(f"round {index + 1}/{rounds}: {variant}, {steps} steps of {requests} deltas")
                rounds_out[variant].append(await one_round(variant))
    finally:
        await publisher.close()
        await receiver.close()
    return {
        variant: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for variant, runs in rounds_out.items()
    }


def measure_deltas(*, requests: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Both variants on a fresh embedded nats-server; see the module docstring."""
    import tempfile

    from bus import event_loop
    from bus.server import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="shoal-bench-deltas-") as store:
        server = EmbeddedNats(store_dir=Path(store), die_with_parent=True).start()
        try:
            return event_loop.run(_run(server.url, requests, steps, rounds))
        finally:
            server.stop()


@click.command("deltas")
@click.option(
    "--requests", type=int, default=32, show_default=True, help="Running requests (deltas per step)."
)
@click.option("--steps", type=int, default=300, show_default=True, help="Steps per round.")
@click.option("--rounds", type=int, default=5, show_default=True, help="Alternating rounds per variant.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_deltas(requests: int, steps: int, rounds: int, json_path: Path | None) -> None:
    """One step's token deltas on the bus: one message per request vs one batch per frontend.

    The defaults take under a minute on two cores; tighter medians: --steps 1000 --rounds 10.
    """
    load_before = os.getloadavg()
    results = measure_deltas(requests=requests, steps=steps, rounds=rounds)
    click.echo(f"{requests} deltas per step, {steps} steps x {rounds} rounds, medians; {os.cpu_count()} CPUs")
    click.echo(f"{'variant':>12} {'publish CPU us':>15} {'all delivered us':>17} {'process CPU us/step':>20}")
    for variant, row in results.items():
        click.echo(
            f"{variant:>12} {row['publish_cpu_us']:>15.0f} {row['delivered_us']:>17.0f} "
            f"{row['process_cpu_us_per_step']:>20.0f}"
        )
    per, batch = results["per_request"], results["batched"]
    ratios = {key: batch[key] / per[key] for key in per if per[key] and key != "incomplete_steps"}
    click.echo(f"steps with a lost delta: per-request {per['incomplete_steps']:.0f}, "
               f"batched {batch['incomplete_steps']:.0f} (median per round)")
    click.echo("batched / per-request: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    if json_path is not None:
        meta = {
            "requests": requests,
            "steps": steps,
            "rounds": rounds,
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "event_loop": "uvloop" if _uvloop() else "asyncio",
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        }
        json_path.write_text(
            json.dumps({"meta": meta, "results": results, "batched_over_per_request": ratios}, indent=2)
            + "\n"
        )
        click.echo(f"wrote {json_path}")


def _uvloop() -> bool:
    from bus import event_loop

    return event_loop.loop_name() == "uvloop"
