"""Goodput in a rate sweep: the SLO from an unloaded run, the share of requests within it, the
highest rate a policy keeps 99% of them there; and the system-prompt groups workload."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from agents.engines.profile import load_profile
from frontend.cli import cli
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.sessions import system_prompt_workload
from scheduler.sim.sweep import SloSpec, SweepSpec, goodput, median_points, run_sweep, unloaded_slo
from scheduler.sim.workload import Workload

A10 = load_profile("llama-7b-a10")


def test_system_prompt_groups_share_one_prompt_per_group_and_the_hot_group_takes_its_share() -> None:
    workload = system_prompt_workload(2000, 10.0, groups=50, system_tokens=600, hot_group_share=0.5, seed=1)
    assert len(workload.requests) == 2000 and not any(r.follows for r in workload.requests)
    systems = Counter(r.segments[0] for r in workload.requests)
    assert all(length == 600 for _, length in systems)
    assert len(systems) == 50
    (_, hot), (_, second) = systems.most_common(2)
    assert 0.45 < hot / 2000 < 0.55 and second < 60  # the rest spread over the other 49
    even = Counter(r.segments[0] for r in system_prompt_workload(2000, 10.0, groups=50, seed=1).requests)
    assert max(even.values()) < 80
    assert "50% of requests in group 0" in workload.description
    with pytest.raises(ValueError, match="hot_group_share"):
        system_prompt_workload(10, 1.0, hot_group_share=1.5)


def _groups(num_requests: int, rate: float, seed: int) -> Workload:
    return system_prompt_workload(
        num_requests, rate, groups=8, system_tokens=512, question_tokens=64, answer_tokens=32, seed=seed
    )


def test_a_sweep_states_its_slo_and_goodput_is_the_highest_rate_where_99_percent_meet_it() -> None:
    spec = SweepSpec(
        workloads=("groups",),
        rates=(2.0, 40.0, 400.0),
        setups=(policy_setup("rr"),),
        num_requests=150,
        seeds=(0, 1),
        builders={"groups": _groups},
        slo=SloSpec(unloaded_requests=30),
    )
    base = SimConfig(profile=A10, num_instances=2, prefix_cache=True)
    slo = unloaded_slo(spec, base, "groups")
    unloaded = slo["unloaded"]
    assert unloaded["rate"] == pytest.approx(0.2)  # a tenth of the lightest rate
    assert unloaded["prefix_cache"] == 0  # the bound is a cold prefill's, whatever a run finds cached
    assert slo["slo"]["ttft_s"] == pytest.approx(5 * unloaded["ttft_p50_s"])
    assert slo["slo"]["tpot_s"] == pytest.approx(2 * unloaded["tpot_p50_s"])
    points = median_points(run_sweep(spec, base, slos={"groups": slo}))
    by_rate = {float(str(p["rate"])): p for p in points}
    for point in points:
        assert point["slo_ttft_s"] == pytest.approx(slo["slo"]["ttft_s"])
    assert float(str(by_rate[2.0]["slo_attainment"])) >= 0.99  # light: nearly unloaded
    assert float(str(by_rate[400.0]["slo_attainment"])) < 0.5  # two A10s cannot keep up
    found = goodput(points, "groups", "rr")
    assert found == 2.0
    assert all(float(str(by_rate[r]["slo_attainment"])) >= 0.99 for r in by_rate if r <= found)


def test_goodput_stops_at_the_first_rate_that_misses_and_is_zero_when_the_lightest_does() -> None:
    def point(rate: float, share: float, policy: str = "a") -> dict[str, object]:
        return {"workload": "w", "policy": policy, "rate": rate, "slo_attainment": share}

    points = [point(1, 1.0), point(2, 0.995), point(3, 0.98), point(4, 0.999), point(1, 0.9, "b")]
    assert goodput(points, "w", "a") == 2.0  # not 4: a lighter rate missed
    assert goodput(points, "w", "b") == 0.0


def test_the_sweep_command_states_the_slo_and_writes_goodput_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "cache"
    args = [
        "simulate",
        "sweep",
        "--workload",
        "groups",
        "--workload",
        "sessions",
        "--rates",
        "1,2",
        "--policies",
        "rr,prefix",
        "--requests",
        "24",
        "--groups",
        "4",
        "--group-system-tokens",
        "256",
        "--think-s",
        "0.5",
        "--unloaded-requests",
        "10",
        "--no-plot",
        "--quiet",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "SLO (groups): TTFT <=" in result.output and "goodput (sessions;" in result.output
    summary = json.loads((tmp_path / "cache-goodput.json").read_text())
    for workload in ("groups", "sessions"):
        assert set(summary[workload]["goodput"]) == {"rr", "prefix"}
        assert summary[workload]["slo"]["ttft_factor"] == 5 and summary[workload]["unloaded"]["rate"] == 0.1
    points = json.loads((tmp_path / "cache.json").read_text())
    assert {p["workload"] for p in points} == {"groups", "sessions"} and len(points) == 8
    assert all(0 <= p["slo_attainment"] <= 1 and p["slo_tpot_s"] > 0 for p in points)
