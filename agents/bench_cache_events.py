"""``python -m agents.bench_cache_events``: prefix-cache event bytes per instance at a stated load.

One ``sim`` instance (LLaMA-7B on an A10 by default) runs on a virtual clock, its prefix cache
on, under an open-loop Poisson load of ``--rate`` requests a second of ``--prompt`` / ``--output``
tokens for ``--duration`` virtual seconds. The defaults are ``shoal bench cluster``'s load per
instance: 128 requests a second over 64 instances, prompt 128, output 32. The agent's own
:class:`~agents.cache_events.CacheEventPublisher` takes the cache's delta after every step and
hands a batch to the bus at most every ``--min-interval`` seconds (its ``min_interval_s``), a
full one every ``full_every_s``; the bytes counted are the encoded envelopes, as sent.

``--prompts`` says what the prompts share: ``same`` (one prompt for every request, as
``shoal bench cluster`` sends), ``shared`` (a common 96-token system prompt, the rest the
request's own) or ``distinct`` (nothing: every prompt block is new, the most events).

With ``--stream`` the batches are also appended to the kv stream of an embedded nats-server
(production retention) and the stream's stored bytes are read back: the log's retention cost
per busy instance-hour, message overhead included.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from typing import Any

import click

from agents.cache_events import CacheEventPublisher, CacheEventsConfig
from agents.engines.sim import SimEngine
from schemas import Codec, SamplingParams, Subjects
from schemas.kv_events import KVCacheEvents

__all__ = ["main", "measure"]

SYSTEM_PROMPT = 96


def _prompt(kind: str, n: int, length: int, rng: random.Random) -> list[int]:
    if kind == "same":
        return list(range(1, length + 1))
    own = [rng.randrange(1, 30_000) for _ in range(length)]
    if kind == "shared":
        return list(range(1, SYSTEM_PROMPT + 1)) + own[SYSTEM_PROMPT:]
    return own


def measure(
    *,
    profile: str,
    rate: float,
    duration_s: float,
    prompt: int,
    output: int,
    prompts: str,
    min_interval_s: float,
    seed: int = 0,
) -> tuple[dict[str, Any], list[tuple[float, bytes]]]:
    """Run the load; the summary and every batch as ``(virtual time, encoded envelope)``."""
    rng = random.Random(seed)
    engine = SimEngine(profile, prefix_cache=True)
    codec = Codec(producer="bench")
    now = 0.0
    sent: list[tuple[float, bytes]] = []

    async def append(subject: str, data: bytes, msg_id: str, timeout: float) -> None:
        sent.append((now, data))

    publisher = CacheEventPublisher(
        engine,
        instance_id="i0",
        block_size=engine.info.block_size,
        subject="bench.kv.i0",
        append=append,
        codec=codec,
        config=CacheEventsConfig(min_interval_s=min_interval_s),
        clock=lambda: now,
    )
    loop = asyncio.new_event_loop()
    last_sent = float("-inf")

    def flush() -> None:
        nonlocal last_sent
        batch = publisher.take_batch()
        if batch is not None:
            loop.run_until_complete(publisher.publish(batch))
            last_sent = now

    sampling = SamplingParams(max_tokens=output, ignore_eos=True)
    arrival, num_requests, num_steps = rng.expovariate(rate), 0, 0
    flush()
    while now < duration_s:
        while arrival <= now:
            engine.add_request(f"r{num_requests}", _prompt(prompts, num_requests, prompt, rng), sampling)
            num_requests += 1
            arrival += rng.expovariate(rate)
        if not engine.has_unfinished():
            now = arrival
            continue
        plan, step_s = engine.begin_step()
        now += step_s
        engine.end_step(plan, step_s)
        publisher.after_step()
        num_steps += 1
        if now - last_sent >= min_interval_s:
            flush()
    loop.close()
    stats = engine.stats()
    batches = [codec.decode(data).body for _, data in sent]
    num_hashes = sum(len(b.stored) + len(b.removed) for b in batches if isinstance(b, KVCacheEvents))
    total = sum(len(data) for _, data in sent)
    summary = {
        "profile": profile,
        "rate": rate,
        "duration_s": duration_s,
        "prompt": prompt,
        "output": output,
        "prompts": prompts,
        "min_interval_s": min_interval_s,
        "requests": num_requests,
        "steps": num_steps,
        "batches": len(sent),
        "batches_per_s": round(len(sent) / duration_s, 2),
        "hashes_per_s": round(num_hashes / duration_s, 1),
        "bytes_per_s": round(total / duration_s, 1),
        "mb_per_instance_hour": round(total / duration_s * 3600 / 1e6, 3),
        "prefix_hit_rate": round(stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 3),
        "evictions": stats.prefix_cache_evictions,
    }
    return summary, sent


async def stream_bytes(sent: list[tuple[float, bytes]]) -> tuple[int, int]:
    """Append every batch to the kv stream of a fresh embedded nats-server; its (bytes, messages)."""
    from bus import BusConfig, JetStreamBus
    from bus.server import EmbeddedNats

    server = EmbeddedNats().start()
    try:
        subjects = Subjects(f"b{uuid.uuid4().hex[:8]}")
        bus = JetStreamBus(BusConfig(url=server.url, subjects=subjects))
        await bus.connect()
        try:
            pipe = bus.appender(max_in_flight=256)
            for n, (_, data) in enumerate(sent, start=1):
                await pipe.append(subjects.kv("i0"), data, msg_id=f"{'0' * 12}:{n}")
            await pipe.flush()
            info = await bus.client.jsm().stream_info(subjects.kv_stream)
            return int(info.state.bytes), int(info.state.messages)
        finally:
            await bus.close()
    finally:
        server.stop()


@click.command()
@click.option("--profile", default="llama-7b-a10", show_default=True)
@click.option("--rate", default=2.0, show_default=True, help="Requests a second to the instance.")
@click.option("--duration", default=600.0, show_default=True, help="Virtual seconds.")
@click.option("--prompt", default=128, show_default=True)
@click.option("--output", default=32, show_default=True)
@click.option(
    "--prompts", type=click.Choice(["same", "shared", "distinct"]), default="same", show_default=True
)
@click.option("--min-interval", default=CacheEventsConfig().min_interval_s, show_default=True)
@click.option("--stream", is_flag=True, help="Also store the batches in a nats-server's kv stream.")
def main(
    profile: str,
    rate: float,
    duration: float,
    prompt: int,
    output: int,
    prompts: str,
    min_interval: float,
    stream: bool,
) -> None:
    summary, sent = measure(
        profile=profile,
        rate=rate,
        duration_s=duration,
        prompt=prompt,
        output=output,
        prompts=prompts,
        min_interval_s=min_interval,
    )
    if stream:
        stored, messages = asyncio.run(stream_bytes(sent))
        summary["stream_bytes"] = stored
        summary["stream_messages"] = messages
        summary["stream_mb_per_instance_hour"] = round(stored / duration * 3600 / 1e6, 3)
    click.echo(json.dumps(summary))


if __name__ == "__main__":
    main()
