"""``shoal events list / follow / export``: filters, JSON lines, live and file sources."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.event_query import EventQuery, parse_time, subject_matches
from schemas import Codec, Subjects
from schemas.instance import InstanceHeartbeat
from tests.scheduler.log_helpers import HISTORY_EVENTS, write_history
from tests.scheduler.service_helpers import connected, delete_streams, new_prefix


@pytest.fixture(scope="module")
async def logged(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, str, Path]]:
    prefix = new_prefix()
    async with connected(nats_url, prefix) as bus:
        await write_history(bus)
    path = tmp_path_factory.mktemp("events") / "cluster.log"
    out = await _shoal("events", "export", "--nats", nats_url, "--prefix", prefix, "--out", str(path))
    assert f"wrote 17 entries ({HISTORY_EVENTS} events, 2 load reports)" in out
    yield nats_url, prefix, path
    await delete_streams(nats_url, prefix)


async def _shoal(*args: str) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def _rows(source: list[str], *args: str) -> list[dict[str, Any]]:
    out = await _shoal("events", "list", "--json", *source, *args)
    return [json.loads(line) for line in out.splitlines() if line]


def _sources(logged: tuple[str, str, Path]) -> list[list[str]]:
    url, prefix, path = logged
    return [["--nats", url, "--prefix", prefix], ["--file", str(path)]]


async def test_list_everything_in_order(logged: tuple[str, str, Path]) -> None:
    for source in _sources(logged):
        rows = await _rows(source)
        assert [r["seq"] for r in rows] == list(range(1, HISTORY_EVENTS + 1))
        assert rows[0]["type"] == "instance_joined" and rows[0]["producer"] == "test"
        with_loads = await _rows(source, "--loads")
        assert [r["type"] for r in with_loads[-2:]] == ["load_report", "load_report"]


async def test_filters_by_request_migration_instance_and_type(logged: tuple[str, str, Path]) -> None:
    for source in _sources(logged):
        r1 = await _rows(source, "--request", "r1")
        assert [r["type"] for r in r1] == [
            "req_arrived",
            "dispatched",
            "req_placed",
            "req_first_token",
            "mig_pre_allocate",
            "mig_ack",
            "mig_stage_done",
            "mig_commit",
            "mig_commit_ack",
            "req_finished",
        ]
        m1 = await _rows(source, "--migration", "m1")
        assert m1[0]["type"] == "mig_pre_allocate" and len(m1) == 5
        assert m1[-1]["subject"].endswith(".ev.mig.m1.outcome")
        dispatched = await _rows(source, "--type", "Dispatched")
        assert [r["body"]["request_id"] for r in dispatched] == ["r1", "r2"]
        i1 = await _rows(source, "--instance", "i1")
        assert [r["type"] for r in i1][:2] == ["instance_joined", "instance_heartbeat"]
        assert "dispatched" not in {r["type"] for r in i1}  # both dispatches went to i2
        assert {r["type"] for r in i1} >= {"mig_pre_allocate", "mig_stage_done", "mig_commit_ack"}
        loads = await _rows(source, "--type", "load_report", "--instance", "i2")
        assert [(r["type"], r["body"]["instance_id"]) for r in loads] == [("load_report", "i2")]
        by_subject = await _rows(source, "--subject", f"{logged[1]}.ev.req.*")
        assert len(by_subject) == 5
        loads = await _rows(source, "--subject", f"{logged[1]}.load.i1")
        assert [(r["type"], r["body"]["instance_id"]) for r in loads] == [("load_report", "i1")]


async def test_time_window_and_limit(logged: tuple[str, str, Path]) -> None:
    url, prefix, path = logged
    rows = await _rows(["--file", str(path)])
    middle = rows[5]["time"]
    after = await _rows(["--file", str(path)], "--since", str(middle), "--limit", "3")
    assert [r["seq"] for r in after] == [6, 7, 8]
    assert await _rows(["--file", str(path)], "--until", "2000-01-01T00:00:00") == []
    assert len(await _rows(["--nats", url, "--prefix", prefix], "--since", "1h")) == HISTORY_EVENTS


async def test_table_for_people_and_unknown_type(logged: tuple[str, str, Path]) -> None:
    path = logged[2]
    out = await _shoal("events", "list", "--file", str(path), "--request", "r2")
    assert "dispatched" in out and "req_arrived" in out and "2 entries" in out
    result = CliRunner().invoke(cli, ["events", "list", "--file", str(path), "--type", "nope"])
    assert result.exit_code == 2 and "unknown event type(s) nope" in result.output


async def test_follow_prints_new_entries(logged: tuple[str, str, Path]) -> None:
    url, prefix, _ = logged
    outputs: list[str] = []
    args = [
        "events",
        "follow",
        "--nats",
        url,
        "--prefix",
        prefix,
        "--type",
        "instance_heartbeat",
        "--instance",
        "i9",
        "--json",
        "--limit",
        "2",
    ]
    thread = threading.Thread(target=lambda: outputs.append(CliRunner().invoke(cli, args).output))
    thread.start()
    try:
        codec = Codec(producer="later")
        async with connected(url, prefix) as bus:
            subjects = Subjects(prefix)
            for seq in range(1, 40):
                await bus.append(
                    subjects.instance("i9"),
                    codec.encode(InstanceHeartbeat(instance_id="i9", seq=seq), time=0.0),
                )
                await bus.append(
                    subjects.instance("i8"),
                    codec.encode(InstanceHeartbeat(instance_id="i8", seq=seq), time=0.0),
                )
                await asyncio.sleep(0.05)
                if not thread.is_alive():
                    break
    finally:
        await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive()
    rows = [json.loads(line) for line in outputs[0].splitlines()]
    assert [(r["body"]["instance_id"], r["body"]["seq"]) for r in rows] == [("i9", 1), ("i9", 2)]


def test_query_maps_filters_to_subjects() -> None:
    subjects = Subjects("p")
    assert EventQuery(request_id="r").server_filters(subjects)[0].subjects == [
        "p.ev.req.r",
        "p.ev.sched.dispatch",
        "p.ev.mig.>",
    ]
    assert EventQuery(migration_id="m").server_filters(subjects)[0].subjects == [
        "p.ev.mig.m",
        "p.ev.mig.m.outcome",
    ]
    assert set(
        EventQuery(types=frozenset({"dispatched", "InstanceFailed"}), instance_id="i")
        .server_filters(subjects)[0]
        .subjects
    ) == {"p.ev.sched.dispatch", "p.ev.instance.i"}
    assert subject_matches("p.ev.mig.>", "p.ev.mig.m.outcome") and not subject_matches("p.ev.*", "p.ev.a.b")


def test_times_are_iso_epoch_or_relative() -> None:
    assert parse_time("10m", now=1000.0) == 400.0
    assert parse_time("1970-01-01T00:01:00", now=0) == 60.0
    assert parse_time("12.5", now=0) == 12.5
    with pytest.raises(ValueError, match="not a time"):
        parse_time("yesterday", now=0)


async def test_a_prefix_without_a_log_is_a_clean_error(nats_url: str) -> None:
    for command in (["events", "list"], ["replay"], ["replay", "--request", "r1"]):
        args = [*command, "--nats", nats_url, "--prefix", "nosuchprefix"]
        result = await asyncio.to_thread(CliRunner().invoke, cli, args)
        assert result.exit_code == 1, (command, result.output)
        assert "no log for prefix 'nosuchprefix'" in result.output, result.output
