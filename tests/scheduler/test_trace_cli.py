"""``shoal trace``: a request's and a migration's trace from the log, in the JSON Jaeger UI uploads."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.logfile import read_bus_log, write_log
from scheduler.timeline import TimelineStep
from scheduler.trace_export import jaeger_trace
from tests.frontend.cluster import frontend_cluster

pytestmark = pytest.mark.slow


def check_jaeger_structure(data: dict[str, Any]) -> dict[str, Any]:
    """What Jaeger UI's JSON upload reads: data[].traceID/spans/processes; spans with ids, refs, µs times."""
    assert set(data) == {"data"} and len(data["data"]) == 1
    trace = data["data"][0]
    assert {"traceID", "spans", "processes"} <= set(trace)
    trace_id = trace["traceID"]
    assert len(trace_id) == 32 and int(trace_id, 16) != 0  # hex, and not the all-zero invalid id
    ids = {span["spanID"] for span in trace["spans"]}
    assert len(ids) == len(trace["spans"])
    for span in trace["spans"]:
        assert span["traceID"] == trace_id and len(span["spanID"]) == 16
        assert isinstance(span["operationName"], str) and span["operationName"]
        assert isinstance(span["startTime"], int) and span["startTime"] > 1_500_000_000 * 10**6  # µs
        assert isinstance(span["duration"], int) and span["duration"] >= 0
        assert span["processID"] in trace["processes"]
        for ref in span["references"]:
            assert ref["refType"] == "CHILD_OF" and ref["traceID"] == trace_id and ref["spanID"] in ids
        for tag in span["tags"]:
            assert {"key", "type", "value"} <= set(tag)
            assert tag["type"] in {"string", "bool", "int64", "float64"}
    assert all("serviceName" in process for process in trace["processes"].values())
    roots = [span for span in trace["spans"] if not span["references"]]
    assert len(roots) == 1
    return trace


def _by_name(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for span in trace["spans"]:
        found.setdefault(span["operationName"], []).append(span)
    return found


def _service(trace: dict[str, Any], span: dict[str, Any]) -> str:
    """``serviceName``, or ``serviceName/instance`` for a process with a ``service.instance.id`` tag."""
    process = trace["processes"][span["processID"]]
    instance = [tag["value"] for tag in process["tags"] if tag["key"] == "service.instance.id"]
    return "/".join([process["serviceName"], *instance])


def _parent(span: dict[str, Any]) -> str:
    return str(span["references"][0]["spanID"])


async def test_shoal_trace_exports_a_migrated_request_and_its_migration_for_jaeger(
    nats_url: str, tmp_path: Path
) -> None:
    async with frontend_cluster(nats_url, instances=2) as cluster:
        assert cluster.gateway is not None
        gateway = cluster.gateway

        async def complete() -> httpx.Response:
            async with cluster.client() as client:
                return await client.post("/v1/completions", json={
                    "model": "sim:tiny-test", "prompt": "hello there", "max_tokens": 150, "ignore_eos": True,
                })

        response = asyncio.ensure_future(complete())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not any(s.first_token_at is not None for s in gateway.streams.values()):
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        (stream,) = gateway.streams.values()
        request_id, source_id = stream.request_id, stream.owner_id
        assert source_id is not None
        destination_id = "i1" if source_id == "i0" else "i0"
        outcome = await cluster.agents[source_id].migrate(request_id, destination_id)
        assert outcome.migrated
        assert (await response).status_code == 200
        await asyncio.sleep(0.3)  # the lifecycle log's last appends
        log = await read_bus_log(cluster.buses[-1])
        live_out = tmp_path / "live.json"  # the same, read from NATS (the CLI runs its own loop)
        live = await asyncio.to_thread(CliRunner().invoke, cli, [
            "trace", request_id, "--nats", nats_url, "--prefix", cluster.subjects.prefix,
            "--out", str(live_out), "--quiet",
        ])
        assert live.exit_code == 0, live.output
    log_file = tmp_path / "log.bin"
    write_log(log_file, log)

    out = tmp_path / "trace.json"
    result = CliRunner().invoke(cli, ["trace", request_id, "--file", str(log_file), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "generate" in result.output and "migration" in result.output  # the waterfall
    trace = check_jaeger_structure(json.loads(out.read_text()))
    assert json.loads(live_out.read_text()) == json.loads(out.read_text())
    spans = _by_name(trace)
    (root,) = spans["request"]
    assert _service(trace, root) == "shoal-frontend"
    generates = sorted(spans["generate"], key=lambda s: s["startTime"])
    expected = [f"shoal-agent/{source_id}", f"shoal-agent/{destination_id}"]
    assert [_service(trace, s) for s in generates] == expected
    assert all(_parent(s) == root["spanID"] for s in generates)
    (migration,) = spans["migration"]
    assert _parent(migration) == generates[0]["spanID"]
    stages = spans["migration.stage"]
    assert stages and all(_parent(s) == migration["spanID"] for s in stages)
    tags = {tag["key"]: tag["value"] for tag in migration["tags"]}
    assert tags["shoal.migration.outcome"] == "committed" and tags["shoal.migration.downtime_ms"] > 0
    assert root["startTime"] <= generates[0]["startTime"]
    assert generates[1]["startTime"] + generates[1]["duration"] <= root["startTime"] + root["duration"]

    migration_id = tags["shoal.migration.id"]
    out = tmp_path / "migration.json"
    result = CliRunner().invoke(cli, ["trace", "--migration", migration_id, "--file", str(log_file),
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    alone = check_jaeger_structure(json.loads(out.read_text()))
    assert [s["operationName"] for s in alone["spans"] if not s["references"]] == ["migration"]

    result = CliRunner().invoke(cli, ["trace", "no-such-request", "--file", str(log_file)])
    assert result.exit_code != 0 and "no events of request" in result.output


def test_a_dispatch_decision_becomes_the_schedulers_span_under_the_request() -> None:
    steps = [
        TimelineStep(1, 1_700_000_000.0, 0.0, "arrived", "", {}),
        TimelineStep(2, 1_700_000_000.001, 0.0, "dispatched", "i1", {"policy": "freeness", "epoch": 3}),
        TimelineStep(3, 1_700_000_000.002, 0.0, "placed", "i1", {"bypass": False}),
        TimelineStep(4, 1_700_000_000.050, 0.0, "first_token", "i1", {}),
        TimelineStep(5, 1_700_000_000.500, 0.0, "finished", "", {"finish_reason": "length"}),
    ]
    trace = check_jaeger_structure(jaeger_trace("r1", steps))
    spans = _by_name(trace)
    (root,), (dispatch,), (generate,) = spans["request"], spans["dispatch"], spans["generate"]
    assert _service(trace, dispatch) == "shoal-scheduler" and _parent(dispatch) == root["spanID"]
    assert {t["key"]: t["value"] for t in dispatch["tags"]}["shoal.dispatch.policy"] == "freeness"
    assert root["duration"] == 500_000 and generate["duration"] == 498_000
    assert [log["fields"][0]["value"] for log in generate["logs"]] == ["first_token"]
    assert jaeger_trace("r1", steps) == jaeger_trace("r1", steps)  # same ids every time


def test_downtime_is_known_whichever_of_commit_and_commit_ack_the_log_stored_first() -> None:
    from scheduler.replay import _migrations
    from schemas.migration import Commit, CommitAck, PreAllocate

    start = PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0,
                        num_blocks=4)
    commit = Commit(migration_id="m", request_id="r", source_id="a", destination_id="b", token_ids=(1, 2),
                    num_prompt_tokens=1, owner_epoch=0, suspended_at=100.0)
    ack = CommitAck(migration_id="m", request_id="r", destination_id="b", owner_epoch=1, resumed_at=100.025)
    for order in ((start, commit, ack), (start, ack, commit)):
        (summary,) = _migrations([(seq, 100.0 + seq, body) for seq, body in enumerate(order, 1)])
        assert summary.outcome == "committed"
        assert summary.downtime_s is not None and abs(summary.downtime_s - 0.025) < 1e-9
