"""``shoal events export`` and ``shoal replay``: a recorded log replays to the same state and decisions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.config import PairingConfig, PolicyConfig
from scheduler.logfile import load_log
from scheduler.service import SchedulerConfig, SchedulerService
from tests.scheduler.service_helpers import FakeAgent, connected, delete_streams, new_prefix, place

RECORDED_TARGET = 7.0


@pytest.fixture(scope="module")
async def recorded(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, str, Path]]:
    """A cluster log with dispatches and pairings, exported to a file."""
    prefix = new_prefix()
    async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
        agents = [
            FakeAgent(agent_bus, "hot", hog_blocks=398),
            FakeAgent(agent_bus, "c1"),
            FakeAgent(agent_bus, "c2"),
        ]
        for agent in agents:
            await agent.start()
        # a pairing target other than the default: replay must recompute with the recorded one
        policy = PolicyConfig(pairing=PairingConfig(target_freeness=RECORDED_TARGET))
        service = SchedulerService(
            sched_bus, SchedulerConfig(lease_ttl_s=1.0, pairing_interval_s=0.1, policy=policy)
        )
        task = asyncio.create_task(service.run())
        await service.wait_active(10)
        for wave in range(4):
            await asyncio.gather(
                *(place(agent_bus, f"w{wave}-{k}", prompt=32 * (k % 5 + 1)) for k in range(20))
            )
            await asyncio.sleep(0.08)
        await asyncio.sleep(0.6)  # idle: the hot instance pairs with a free one
        await service.stop()
        await asyncio.wait_for(task, 10)
        for agent in agents:
            await agent.stop()
    path = tmp_path_factory.mktemp("log") / "cluster.log"
    result = await _shoal("events", "export", "--nats", nats_url, "--prefix", prefix, "--out", str(path))
    assert "wrote" in result
    yield nats_url, prefix, path
    await delete_streams(nats_url, prefix)


async def _shoal(*args: str) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def _json(*args: str) -> dict[str, Any]:
    return json.loads(await _shoal("replay", "--json", "--limit", "1000", *args))  # type: ignore[no-any-return]


async def test_replay_of_a_file_recomputes_every_decision_and_is_repeatable(
    recorded: tuple[str, str, Path],
) -> None:
    url, prefix, path = recorded
    first = await _json("--file", str(path))
    second = await _json("--file", str(path))
    assert first == second
    assert len(first["dispatches"]) == 80
    assert first["decisions_recomputed"] > 80  # pairing decisions too
    assert first["decisions_equal"] == first["decisions_recomputed"]
    assert {row["instance_id"] for row in first["instances"]} == {"hot", "c1", "c2"}
    assert any(p["source_id"] == "hot" for p in first["pairings"])
    assert [p["pairing"]["target_freeness"] for p in first["policies"].values()] == [RECORDED_TARGET]
    assert {p["target_freeness"] for p in first["pairings"]} == {RECORDED_TARGET}
    # the recorded rules win over the command line's (which only serve logs that record none)
    assert await _json("--file", str(path), "--target-freeness", "1.5") == first
    live = await _json("--nats", url, "--prefix", prefix)
    assert live["cursor"] == first["cursor"] and live["instances"] == first["instances"]


async def test_replay_at_an_earlier_position_shows_the_state_then(recorded: tuple[str, str, Path]) -> None:
    _, _, path = recorded
    full = await _json("--file", str(path))
    middle = full["dispatches"][40]["seq"]
    partial = await _json("--file", str(path), "--at-seq", str(middle))
    assert partial["cursor"]["events_seq"] == middle
    assert len(partial["dispatches"]) == 41
    assert partial["decisions_equal"] == partial["decisions_recomputed"]


async def test_what_if_reports_where_another_policy_decides_differently(
    recorded: tuple[str, str, Path],
) -> None:
    _, _, path = recorded
    same = await _json("--file", str(path), "--what-if")
    assert same["what_if"]["num_differ"] == 0
    other = await _json(
        "--file",
        str(path),
        "--what-if",
        "--what-if-policy",
        "round_robin",
        "--what-if-low",
        "1",
        "--what-if-high",
        "500",
    )
    kinds = {row["kind"] for row in other["what_if"]["differences"]}
    assert other["what_if"]["num_differ"] > 0 and kinds == {"dispatch", "pairing"}
    assert any(row["alternative"] == "hot" for row in other["what_if"]["differences"])  # round robin hits it


async def test_replay_prints_tables_for_people(recorded: tuple[str, str, Path]) -> None:
    _, _, path = recorded
    output = await _shoal("replay", "--file", str(path), "--limit", "3")
    for title in ("instances", "pairings", "migrations", "dispatch decisions"):
        assert title in output
    assert "equal to the recorded ones" in output


async def test_time_travel_shows_what_changed_between_instants(recorded: tuple[str, str, Path]) -> None:
    _, _, path = recorded
    log = load_log(path)
    start, end = log.events[0].time, log.events[-1].time
    step = (end - start) / 4 + 0.001
    args = ("replay", "--file", str(path), "--at-time", repr(start), "--step", repr(step), "--steps", "4")
    data = json.loads(await _shoal(*args, "--json"))
    assert len(data["steps"]) == 4
    found = [change for s in data["steps"] for change in s["changes"]]
    assert {c["subject"] for c in found if c["field"] == "instance"} | set(data["view"]["instances"]) == {
        "hot",
        "c1",
        "c2",
    }
    assert any(c["field"] == "running" for c in found)  # requests came and went
    assert any(c["subject"] == "pairing hot" and c["after"] != "-" for c in found)  # the hot one was paired
    # the first view plus every change is the view at the last instant
    end_view = json.loads(
        await _shoal(
            "replay",
            "--file",
            str(path),
            "--at-time",
            repr(start + 4 * step),
            "--step",
            "1",
            "--steps",
            "0",
            "--json",
        )
    )["view"]
    rebuilt = {i: {k: str(v) for k, v in row.items()} for i, row in data["view"]["instances"].items()}
    for change in found:
        if change["field"] not in ("instance", "destination"):
            rebuilt.setdefault(change["subject"], {})[change["field"]] = change["after"]
    for instance_id, row in end_view["instances"].items():
        for name in ("status", "running", "waiting", "used_blocks", "pending"):
            assert rebuilt[instance_id][name] == str(row[name]), (instance_id, name)
    text = await _shoal(*args)
    assert "cluster at" in text and "changes" in text and "pairing hot" in text
