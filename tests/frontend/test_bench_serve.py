"""``shoal bench serve``'s account of where shoal's wall time goes, and the benchmark end to end.

The step totals are read from a real agent metrics registry over HTTP, as the
benchmark reads its agents'; the end-to-end run is the ``tiny`` preset at two
streams of eight tokens, whose numbers are checked for consistency, not speed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from agents.engines.protocol import StepResult
from agents.metrics import AgentMetrics
from frontend.bench_serve import child_pids
from frontend.bench_steps import StepTotals, scrape_step_totals, step_breakdown

SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]


def _serve(registry: CollectorRegistry) -> tuple[str, Any]:
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return f"http://127.0.0.1:{server.server_port}/metrics", server


def _stop(server: Any) -> None:
    server.shutdown()
    server.server_close()


def test_step_totals_come_from_the_agents_step_histogram_summed_over_agents() -> None:
    urls, servers = [], []
    for durations in ((0.02, 0.03), (0.5,)):
        metrics = AgentMetrics(lambda: None)
        for seconds in durations:
            metrics.observe_step(StepResult(outputs=[], duration_s=seconds, num_scheduled=4))
        # an idle step (nothing scheduled) is not counted as one
        metrics.observe_step(StepResult(outputs=[], duration_s=9.0, num_scheduled=0))
        url, server = _serve(metrics.registry)
        urls.append(url)
        servers.append(server)
    try:
        totals = scrape_step_totals(urls)
        assert totals.steps == 3
        assert math.isclose(totals.seconds, 0.55)
        assert totals - StepTotals(1, 0.5) == StepTotals(2, totals.seconds - 0.5)
    finally:
        for server in servers:
            _stop(server)


def test_a_metrics_endpoint_without_the_step_histogram_is_an_error_that_names_it() -> None:
    url, server = _serve(CollectorRegistry())
    try:
        with pytest.raises(RuntimeError, match="shoal_agent_step_duration_seconds"):
            scrape_step_totals([url])
    finally:
        _stop(server)


def test_the_wall_ratio_splits_into_steps_time_per_step_and_idle() -> None:
    # direct: 100 steps of 10 ms in a 1.0 s wall; shoal: 101 steps of 11 ms in a 1.2 s wall
    split = step_breakdown(StepTotals(101, 1.111), 1.2, StepTotals(100, 1.0), 1.0)
    assert math.isclose(split["wall_factor"], 1.2)
    assert math.isclose(split["steps_factor"], 1.01)
    assert math.isclose(split["step_s_factor"], 1.1)
    assert math.isclose(split["shoal_busy"], 1.111 / 1.2)
    assert math.isclose(split["direct_busy"], 1.0)
    assert math.isclose(split["shoal_idle_ms"], 89.0)
    assert math.isclose(split["direct_idle_ms"], 0.0, abs_tol=1e-9)
    assert math.isclose(split["step_time_factor"] * split["idle_factor"], split["wall_factor"])
    # two instances: the busy share is per engine
    assert math.isclose(step_breakdown(StepTotals(10, 1.0), 1.0, StepTotals(10, 1.0), 1.0, instances=2)
                        ["shoal_busy"], 0.5)
    # nothing measured: no figures rather than a division by zero
    assert all(math.isnan(v) for v in step_breakdown(StepTotals(), 1.0, StepTotals(5, 1.0), 1.0).values())


@pytest.mark.slow
def test_bench_serve_reports_each_round_and_where_its_wall_went(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    completed = subprocess.run(
        [*SHOAL, "bench", "serve", "--preset", "tiny", "--concurrency", "2", "--prompt-tokens", "8",
         "--max-tokens", "8", "--rounds", "2", "--grammar", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False, env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert list(scratch.glob("shoal-*")) == []  # the children's logs and NATS store went with them
    result = json.loads(out.read_text())["results"]["2"]
    assert result["shoal_tokens"] == result["direct_tokens"] == 2 * 8
    # the direct engine prefills both prompts in one step, then decodes 7 more; shoal's agent takes
    # at least as many steps (one more where the second request arrives during the first's prefill)
    assert result["direct_steps"] == 8
    assert 8 <= result["shoal_steps"] <= 16
    assert 0 < result["shoal_step_s"] and 0 < result["direct_step_s"]
    assert [pair["direct_first"] for pair in result["rounds"]] == [0.0, 1.0]  # the order alternates
    for pair in result["rounds"]:
        assert 0 < pair["shoal_busy"] <= 1 and 0 < pair["direct_busy"] <= 1
        assert math.isclose(pair["steps_factor"] * pair["step_s_factor"] * pair["idle_factor"],
                            pair["wall_factor"], rel_tol=1e-9)
        assert math.isclose(pair["ratio"], 1 / pair["wall_factor"], rel_tol=1e-9)  # same tokens both sides
    assert "where shoal's wall goes" in completed.stdout
    # --grammar: the same bursts with a json_schema response_format, paired with the plain ones; the
    # built-in schema never completes within max_tokens, so both generate the same tokens
    constrained = result["json_schema"]
    assert constrained["tokens"] == 2 * 8
    assert len(constrained["paired_ratios"]) == 2 and all(r > 0 for r in constrained["paired_ratios"])
    assert "json_schema response_format on every request" in completed.stdout


def _descendants(pid: int) -> set[int]:
    found = set()
    for child in child_pids(pid):
        found |= {child, *_descendants(child)}
    return found


@pytest.mark.slow
def test_sigterm_stops_bench_serve_and_everything_it_started(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [*SHOAL, "bench", "serve", "--preset", "tiny", "--concurrency", "2", "--prompt-tokens", "8",
         "--max-tokens", "400", "--rounds", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 120
        started: set[int] = set()
        while time.monotonic() < deadline and process.poll() is None:
            started = _descendants(process.pid)
            if len(started) >= 3 and list(tmp_path.glob("shoal-bench-serve-*/frontend.log")):
                break  # nats-server, the agent and the frontend are up
            time.sleep(0.2)
        assert len(started) >= 3, "bench serve did not start its cluster"
        time.sleep(5)  # into the rounds
        started |= _descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in started):
        time.sleep(0.2)
    assert [pid for pid in started if Path(f"/proc/{pid}").exists()] == []
    assert list(tmp_path.glob("shoal-bench-serve-*")) == []
