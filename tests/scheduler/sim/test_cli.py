"""``shoal simulate`` and ``shoal simulate sweep`` as a user runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from agents.engines.profile import PROFILES_DIR
from frontend.cli import cli
from scheduler.sim.metrics import LATENCY_KEYS
from scheduler.sim.sweep import knee

SINGLE_RUN_KEYS = {
    *LATENCY_KEYS, "preemptions", "preemption_loss_s", "fragmentation_mean", "migrations", "churn",
    "rejected", "instances_mean", "wall_s", "by_priority",
}


def test_one_run_writes_the_json_document_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = CliRunner().invoke(cli, [
        "simulate", "--trace", "azure-conv", "--requests", "50", "--rate", "4", "--instances", "4",
        "--high-share", "0.2", "--json", str(out), "--plots", str(tmp_path / "plots"), "--quiet",
        "--autoscale", "--sustain-s", "1", "--startup-delay-s", "2", "--max-instances", "6",
    ])
    assert result.exit_code == 0, result.output
    assert "Azure LLM inference trace 2023" in result.output  # the trace is credited
    data = json.loads(out.read_text())
    assert SINGLE_RUN_KEYS <= set(data)
    assert set(data["by_priority"]) == {"high", "normal"}
    assert set(LATENCY_KEYS) <= set(data["by_priority"]["high"])
    assert data["policy"] == "shoal" and data["num_finished"] + data["rejected"] == 50
    assert (tmp_path / "plots" / "fragmentation.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "instances.png").stat().st_size > 1000


def test_a_profile_file_can_stand_in_for_the_default(tmp_path: Path) -> None:
    profile = tmp_path / "measured.json"
    shutil.copy(PROFILES_DIR / "tiny-test.json", profile)
    out = tmp_path / "run.json"
    result = CliRunner().invoke(cli, [
        "simulate", "--mix", "S-S", "--rate", "5", "--requests", "80", "--instances", "2",
        "--profile", str(profile), "--policy", "rr", "--json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["parameters"]["profile"] == "tiny-test"
    assert data["rejected"] > 0  # S-S prompts reach 6k tokens; this instance holds 256


def test_sweep_runs_every_rate_and_policy_and_plots(tmp_path: Path) -> None:
    prefix = tmp_path / "sweep" / "mm"
    result = CliRunner().invoke(cli, [
        "simulate", "sweep", "--workload", "M-M", "--rates", "2,4", "--policies", "infaas,shoal",
        "--requests", "30", "--instances", "2", "--out", str(prefix), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    points = json.loads(prefix.with_suffix(".json").read_text())
    assert {(p["rate"], p["policy"]) for p in points} == {(2.0, "infaas"), (4.0, "infaas"),
                                                           (2.0, "shoal"), (4.0, "shoal")}
    assert all(p["workload"] == "M-M" and "Poisson" in p["workload_description"] for p in points)
    assert prefix.with_suffix(".png").stat().st_size > 1000


def test_unknown_policy_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["simulate", "--policy", "fastest", "--quiet"])
    assert result.exit_code == 2


def test_several_policies_compare_on_one_workload(tmp_path: Path) -> None:
    out = tmp_path / "both.json"
    result = CliRunner().invoke(cli, [
        "simulate", "--mix", "L-L", "--rate", "6", "--requests", "40", "--instances", "3",
        "--policy", "infaas,shoal", "--json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == {"infaas", "shoal"}
    assert data["infaas"]["migrations"] == 0
    assert "infaas" in result.output and "shoal" in result.output


def test_sweep_over_seeds_writes_medians_and_finds_the_knee(tmp_path: Path) -> None:
    prefix = tmp_path / "seeds" / "mm"
    result = CliRunner().invoke(cli, [
        "simulate", "sweep", "--workload", "M-M", "--rates", "2,40", "--policies", "infaas",
        "--requests", "20", "--instances", "2", "--seeds", "0,1,2", "--out", str(prefix), "--quiet",
        "--no-plot",
    ])
    assert result.exit_code == 0, result.output
    runs = json.loads(prefix.with_suffix(".json").read_text())
    assert sorted((p["rate"], p["seed"]) for p in runs) == [(r, s) for r in (2.0, 40.0) for s in (0, 1, 2)]
    medians = json.loads((tmp_path / "seeds" / "mm-median.json").read_text())
    light = [p for p in runs if p["rate"] == 2.0]
    [median] = [p for p in medians if p["rate"] == 2.0]
    assert median["seeds"] == [0, 1, 2]
    assert median["ttft_p99_s"] == sorted(p["ttft_p99_s"] for p in light)[1]
    assert "knee (M-M; P99 TTFT within 3x of the lightest rate's): infaas " in result.output


def test_seeds_past_a_trace_s_end_are_refused_before_any_run(tmp_path: Path) -> None:
    """On a trace a seed is a window of its rows: one the trace does not hold in full is a clear
    error up front, not a median that mixes window sizes (or a traceback after the other runs)."""
    trace = tmp_path / "short.csv"
    rows = "".join(f"{i / 10},20,5\n" for i in range(50))
    trace.write_text("arrival_s,input_tokens,output_tokens\n" + rows)
    prefix = tmp_path / "out" / "short"
    result = CliRunner().invoke(cli, [
        "simulate", "sweep", "--workload", str(trace), "--rates", "2", "--policies", "infaas",
        "--requests", "20", "--instances", "2", "--seeds", "0,1,2", "--out", str(prefix), "--quiet",
        "--no-plot",
    ])
    assert result.exit_code == 1, result.output
    assert "seed 2 is rows 40-59 of the trace, which holds only 10 of them" in result.output
    assert not prefix.with_suffix(".json").exists()  # nothing ran


def test_the_knee_is_the_last_rate_before_p99_ttft_leaves_three_times_the_lightest() -> None:
    curve = {2.0: 1.0, 4.0: 1.4, 6.0: 2.9, 8.0: 9.0, 10.0: 2.0}  # 10 is noise past the knee
    points: list[dict[str, object]] = [
        {"workload": "w", "policy": "p", "rate": r, "ttft_p99_s": v} for r, v in curve.items()
    ]
    assert knee(points, "w", "p") == 6.0
    assert knee(points, "w", "other") is None
