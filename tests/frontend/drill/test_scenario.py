"""Scenario files as a user writes them: a bad one is an error naming the field; good ones load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from frontend.drill.scenario import BUILTIN, FaultKind, ScenarioError, Target, load_scenario, resolve


def _write(tmp_path: Path, text: str, name: str = "my-drill.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_toml_scenario_loads_with_its_phases_load_and_fault(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
description = "kill the scheduler under a streaming load"
[cluster]
engine = "sim"
instances = 2
[load]
rate = 8
output_tokens = 16
stream_share = 1.0
greedy_share = 0.25
[phases]
steady_s = 2
fault_s = 1
recovery_s = 3
[fault]
kind = "kill"
target = "scheduler"
""",
    )
    scenario = load_scenario(path)
    assert scenario.name == "my-drill"
    assert scenario.cluster.instances == 2
    assert scenario.load.rate == 8 and scenario.load.stream_share == 1.0
    assert scenario.fault.kind is FaultKind.KILL and scenario.fault.target is Target.SCHEDULER
    assert resolve(str(path)) == [scenario]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[load]\nrate = -1\n", "load.rate"),
        ("[load]\nstream_share = 1.5\n", "load.stream_share"),
        ('[cluster]\nengine = "gpu"\n', "cluster.engine"),
        ("[cluster]\ninstancez = 2\n", "cluster.instancez"),
        ('[fault]\nkind = "explode"\n', "fault.kind"),
        ('[fault]\nkind = "kill"\n', "fault"),  # a kill needs a target
        ('[fault]\nkind = "latency"\ntarget = "scheduler"\n', "fault"),
        ('[phases]\nsteady_s = "long"\n', "phases.steady_s"),
        ('[cluster]\ninstances = 2\n[cluster.first_step_faults]\n5 = "exit"\n', "cluster"),  # no agent-5
        ('[cluster.first_step_faults]\n0 = "hang"\n', "cluster.first_step_faults.0"),
        ('[fault]\nkind = "stop"\ntarget = "agents"\n', "fault"),  # every agent at once: a kill only
        ('[fault]\nkind = "crash_loop"\ntarget = "agent"\n', "(top level)"),  # nothing brings it back
        ('[fault]\nkind = "first_step"\n', "(top level)"),  # which agents?
    ],
)
def test_a_bad_scenario_file_is_an_error_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"{field}:" in message or f"{field}." in message, message


def test_not_toml_and_unknown_names_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(_write(tmp_path, "[load\nrate = 1"))
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ScenarioError, match="unknown scenario 'no-such-drill'"):
        resolve("no-such-drill")


def test_shoal_drill_rejects_a_bad_file_with_status_2_and_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, "[load]\noutput_tokens = 0\n")
    done = subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", "drill", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "load.output_tokens" in done.stderr


def test_the_built_in_suite_covers_each_component_s_kill_stop_and_network_faults() -> None:
    kinds = {(s.fault.kind, s.fault.target) for s in BUILTIN.values()}
    for needed in [
        (FaultKind.KILL, Target.SCHEDULER),
        (FaultKind.STOP, Target.SCHEDULER),
        (FaultKind.KILL, Target.AGENT_IDLE),
        (FaultKind.KILL, Target.MIGRATION_SOURCE),
        (FaultKind.KILL, Target.MIGRATION_DESTINATION),
        (FaultKind.TERM, Target.MIGRATION_SOURCE),
        (FaultKind.KILL, Target.FRONTEND),
        (FaultKind.KILL, Target.NATS),
        (FaultKind.RESTART, Target.NATS),
        (FaultKind.LATENCY, Target.BUS),
        (FaultKind.BLACKHOLE, Target.BUS),
        (FaultKind.BLACKHOLE, Target.KV),
        (FaultKind.ROLLING_RESTART, None),
        (FaultKind.KILL, Target.AGENTS),
        (FaultKind.CRASH_LOOP, Target.AGENT),
        (FaultKind.FIRST_STEP, None),
    ]:
        assert needed in kinds


@pytest.mark.parametrize("engine", ["sim", "torch", "vllm"])
def test_a_scenario_that_times_a_copy_out_keeps_its_requests_alive_past_the_timeout(engine: str) -> None:
    # kv-blackhole's migration must end by its copy timeout, not by its request finishing first:
    # on every engine, a request's steps alone (at the scenario's pace) outlast the timeout twice
    scenario = BUILTIN["kv-blackhole"]
    cluster = scenario.cluster.on_engine(engine)  # type: ignore[arg-type]
    assert scenario.verdicts.expect_migration_abort
    assert scenario.load.output_tokens * cluster.min_step_s >= 2 * cluster.copy_timeout_s


def test_a_yaml_scenario_loads_and_a_bad_one_names_the_field(tmp_path: Path) -> None:
    good = _write(tmp_path, "cluster:\n  instances: 2\nfault:\n  kind: stop\n  target: nats\n", "y.yaml")
    scenario = load_scenario(good)
    assert scenario.name == "y" and scenario.fault.target is Target.NATS
    bad = _write(tmp_path, "load:\n  greedy_share: 2\n", "bad.yml")
    with pytest.raises(ScenarioError, match=r"load\.greedy_share"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="top level"):
        load_scenario(_write(tmp_path, "- just\n- a list\n", "list.yaml"))
