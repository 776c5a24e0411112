"""`shoal bench cluster --repeats`: phases in turn with a new scheduler after each phase without one,
and a row of medians per phase (a real nats-server, a real `shoal scheduler` and sim agent processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.server import EmbeddedNats
from scheduler.bench_cluster import run_cluster_bench

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # a scheduler and sim agents as processes


async def test_repeated_phases_restart_the_scheduler_and_report_medians(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    rows = await run_cluster_bench(
        nats_server.url, rates=(20.0,), duration=1.5, instances=4, processes=1, workdir=tmp_path,
        nats_pid=nats_server.pid, repeats=2,
    )
    runs = [row for row in rows if row["repeat"] != "median"]
    assert [(row["phase"], row["repeat"]) for row in runs] == [
        ("rate20", 0), ("nosched20", 0), ("rate20", 1), ("nosched20", 1)
    ]
    assert all(row["errors"] == 0 and row["dispatch_p50_ms"] is not None for row in runs)
    # every round's requests are new to the agents (ids are per round), so every phase has steps to time
    assert all(row["agent_step_lag_p99_ms"] is not None for row in runs)
    # the second round's scheduler is a new process, recovered from the log, and it placed every request
    with_scheduler = [row for row in runs if row["scheduler"]]
    assert all(row["scheduler_rpc_p50_ms"] is not None for row in with_scheduler)
    assert with_scheduler[1]["scheduler_cpu_ms_per_request"] > 0
    medians = {row["phase"]: row for row in rows if row["repeat"] == "median"}
    assert set(medians) == {"rate20", "nosched20"} and medians["rate20"]["repeats"] == 2
    p50s = sorted(row["dispatch_p50_ms"] for row in with_scheduler)
    assert medians["rate20"]["dispatch_p50_ms"] == pytest.approx(sum(p50s) / 2, abs=1e-3)
