"""``shoal bench migration`` runs end to end on a tiny model: every method measured, live in stages.

Its client watches a token subject on which agents also send orphan probes; a probe once ended the
client's loop, and every run longer than the probe interval timed out ("tokens before the move").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_migration_measures_every_method_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "migration.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", "bench", "migration",
         "--preset", "tiny", "--seq-lens", "64", "--repeats", "1", "--recompute-long-repeats", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert list(scratch.glob("shoal-*")) == []  # the embedded NATS server's store went with it
    rows = json.loads(out.read_text())
    text = json.dumps(rows)
    # what the downtime carries: the blocks copied while suspended (at least the partial block)
    assert rows[0]["live_last_stage_blocks"] >= 1, rows[0]
    for method in ("live", "blocking", "recompute"):
        assert f'"{method}"' in text, text[:2000]
    assert "seq_len" in done.stdout and (tmp_path / "migration.png").exists()


async def test_the_benchmark_client_counts_deltas_and_ignores_an_agents_probe() -> None:
    """A probe on the watched token subject (agents send them) is not a delta: it is skipped, and
    the deltas after it are still counted (the client's loop died on a probe before)."""
    import asyncio

    from agents.bench_migration import Client
    from bus.memory import MemoryBus
    from schemas import Codec, TokenDelta
    from schemas.rpc import TokenProbe

    bus, codec = MemoryBus(), Codec()
    await bus.connect()
    client = Client(bus, codec)
    subscription, collector = await client.watch("t.tok.r")
    await bus.publish("t.tok.r", codec.encode(TokenProbe(request_id="r", instance_id="a"), time=0.0))
    for index in range(3):
        delta = TokenDelta(request_id="r", instance_id="a", owner_epoch=0, first_index=index, token_ids=(7,))
        await bus.publish("t.tok.r", codec.encode(delta, time=0.0))
    async with asyncio.timeout(5):
        while client.count(0) < 3:
            await asyncio.sleep(0.01)
    assert not collector.done()
    await subscription.unsubscribe()
    collector.cancel()
    await bus.close()
