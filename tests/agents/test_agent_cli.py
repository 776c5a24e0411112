"""``shoal agent`` as a user runs it: a subprocess that serves, streams, has /metrics, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from agents.engines.sim import sim_token_id
from schemas import (
    FinishReason,
    GenerateRequest,
    InstanceJoined,
    InstanceLeft,
    InstanceTerminating,
    RejectReason,
    TerminateReason,
)
from tests.agents.agent_cluster import agent_cluster, greedy
from tests.scrape import scrape, value


@pytest.mark.e2e
async def test_shoal_agent_serves_and_leaves_cleanly(nats_url: str, tmp_path: Path) -> None:
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from frontend.cli import main; main()",
            "agent",
            "--engine",
            "sim",
            "--nats",
            nats_url,
            "--prefix",
            cluster.subjects.prefix,
            "--instance-id",
            "cli1",
            "--transport",
            "tcp",
            "--ready-file",
            str(ready),
            "--metrics-port",
            "0",
            "--log-level",
            "WARNING",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(30):
                while not ready.exists():
                    await asyncio.sleep(0.05)
            info = json.loads(ready.read_text())
            assert info["instance_id"] == "cli1" and info["transport_address"].startswith("tcp://")
            watcher = await cluster.watch("c1")
            reply = await cluster.generate(
                "cli1", GenerateRequest(request_id="c1", token_ids=(1, 2, 3), sampling=greedy(10))
            )
            assert reply.accepted
            await watcher.wait_finished()
            assert watcher.tokens() == [sim_token_id("c1", None, i, 1000, 0) for i in range(10)]
            await watcher.close()
            samples = await scrape(info["metrics_url"])  # --metrics-port 0: a free port, in the ready file
            assert value(samples, "shoal_agent_step_duration_seconds_count") >= 10
            assert value(samples, "shoal_agent_kv_blocks") > 0
            assert value(samples, "shoal_gc_frozen_objects") > 10_000  # its start-up heap (bus/heap.py)
            assert value(samples, "shoal_gc_pause_seconds_count", generation="2") >= 1  # the freeze's
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        events = [env.body for _, env in await cluster.stored(cluster.subjects.instance("cli1"))]
        assert isinstance(events[0], InstanceJoined) and events[0].engine == "sim"
        assert isinstance(events[-1], InstanceLeft)


async def _start_agent(
    nats_url: str, prefix: str, instance_id: str, ready: Path
) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from frontend.cli import main; main()",
        "agent",
        "--engine",
        "sim",
        "--time-scale",
        "30",
        "--nats",
        nats_url,
        "--prefix",
        prefix,
        "--instance-id",
        instance_id,
        "--transport",
        "tcp",
        "--ready-file",
        str(ready),
        "--log-level",
        "WARNING",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(30):
        while not ready.exists():
            await asyncio.sleep(0.05)
    return process


@pytest.mark.e2e
async def test_sigterm_drains_and_a_second_sigterm_stops(nats_url: str, tmp_path: Path) -> None:
    """SIGTERM: the agent announces terminating, refuses new work, lets its request run (no scheduler
    here to move it), and leaves once it is done; a second SIGTERM stops a drain at once."""
    async with agent_cluster(nats_url) as cluster:
        prefix = cluster.subjects.prefix
        process = await _start_agent(nats_url, prefix, "drain1", tmp_path / "ready1.json")
        watcher = await cluster.watch("long")
        reply = await cluster.generate(
            "drain1", GenerateRequest(request_id="long", token_ids=(1, 2, 3), sampling=greedy(40))
        )
        assert reply.accepted
        await asyncio.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            while not [
                e
                for _, e in await cluster.stored(cluster.subjects.instance("drain1"))
                if isinstance(e.body, InstanceTerminating)
            ]:
                await asyncio.sleep(0.05)
        refused = await cluster.generate(
            "drain1", GenerateRequest(request_id="late", token_ids=(1, 2), sampling=greedy(4))
        )
        assert not refused.accepted and refused.reason is RejectReason.TERMINATING
        assert process.returncode is None  # still serving its request
        await watcher.wait_finished(30)
        assert len(watcher.tokens()) == 40 and watcher.deltas[-1].finish_reason is FinishReason.LENGTH
        output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        events = [e.body for _, e in await cluster.stored(cluster.subjects.instance("drain1"))]
        assert isinstance(events[-1], InstanceLeft)
        assert [e.reason for e in events if isinstance(e, InstanceTerminating)] == [
            TerminateReason.STOP_SIGNAL
        ]
        await watcher.close()

        process = await _start_agent(nats_url, prefix, "drain2", tmp_path / "ready2.json")
        reply = await cluster.generate(
            "drain2", GenerateRequest(request_id="longer", token_ids=(1, 2, 3), sampling=greedy(100_000))
        )
        assert reply.accepted
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert process.returncode is None  # draining: the request would run for minutes
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), 10)
        assert process.returncode == 0, output.decode()


def test_fault_options_become_the_agents_fault_plan() -> None:
    import click

    from agents.cli import fault_plan
    from agents.engines.agent_cli import AgentCliConfig, FaultOptions
    from bus.cli_config import from_argv

    options = from_argv(AgentCliConfig, ["--fault-drop", "out:Commit", "--fault-drop", "in:Ack",
                                         "--fault-duplicate", "out:PreAllocate", "--fault-max", "1",
                                         "--fault-copy-delay", "0.25"])
    plan = fault_plan(options.faults)
    assert plan.drop_outgoing == {"Commit"} and plan.drop_incoming == {"Ack"}
    assert plan.duplicate_outgoing == {"PreAllocate"} and plan.max_faults == 1 and plan.copy_delay_s == 0.25
    assert fault_plan(FaultOptions()).is_empty
    with pytest.raises(click.BadParameter, match="in:TYPE or out:TYPE"):
        from_argv(AgentCliConfig, ["--fault-drop", "sideways:Commit"])
    with pytest.raises(click.BadParameter, match="unknown migration message types"):
        fault_plan(FaultOptions(fault_duplicate=("out:Bogus",)))


def test_agents_and_the_simulator_start_with_the_same_migration_pacing() -> None:
    """`shoal agent` and `shoal simulate` default to MigrationConfig()'s copy pacing (off)."""
    from agents.cli import agent
    from agents.migration.fsm.config import MigrationConfig
    from scheduler.sim.cli import simulate_command, sweep_command

    def default(command: object, name: str) -> object:
        params = getattr(command, "params", [])
        return next(p.default for p in params if p.name == name)

    share = MigrationConfig().copy_step_share
    assert default(agent, "migration_copy_share") == share
    for command in (simulate_command, sweep_command):
        assert default(command, "copy_share") == share


@pytest.mark.e2e
async def test_shoal_agent_with_a_core_process_serves_and_ends_it(nats_url: str, tmp_path: Path) -> None:
    """``--engine-core process``: the tokens of the in-process engine, and SIGINT ends the child too."""
    from agents.engines.torch_engine import TorchEngine
    from frontend.bench_serve import child_pids
    from tests.agents.agent_cluster import unmigrated_tokens

    prompt = (5, 9, 13, 17, 21)
    expected = unmigrated_tokens(TorchEngine("tiny", num_blocks=32), prompt, greedy(12), "p1")
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from frontend.cli import main; main()", "agent", "--engine", "torch",
            "--model", "tiny", "--num-blocks", "32", "--engine-core", "process", "--nats", nats_url,
            "--prefix", cluster.subjects.prefix, "--instance-id", "core1", "--transport", "tcp",
            "--ready-file", str(ready), "--log-level", "WARNING",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(60):
                while not ready.exists():
                    await asyncio.sleep(0.05)
            (core,) = child_pids(process.pid)
            watcher = await cluster.watch("p1")
            reply = await cluster.generate("core1", GenerateRequest(request_id="p1", token_ids=prompt,
                                                                    sampling=greedy(12)))
            assert reply.accepted
            await watcher.wait_finished()
            assert watcher.tokens() == expected
            await watcher.close()
        finally:
            process.send_signal(signal.SIGINT)
            output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        assert not Path(f"/proc/{core}").exists()
