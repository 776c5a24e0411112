"""Trace files as published (Azure, BurstGPT, Mooncake) read the same as shoal's own CSV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.sim.trace_formats import read_trace
from scheduler.sim.workload import AZURE_CREDIT, load_trace

#: (arrival s, prompt tokens, output tokens) the files below all hold, in arrival order
ROWS = [(0.0, 374, 44), (0.25, 396, 109), (1.5, 879, 7), (4.0, 91, 12)]


def _write(folder: Path, name: str, header: str, lines: list[str]) -> Path:
    path = folder / name
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def _files(folder: Path) -> dict[str, Path]:
    """The same requests in each format; each file's rows out of order, one row in each to drop."""
    order = [2, 0, 3, 1]
    stamp = "2023-11-16 18:15:{:09.6f}0"  # Azure's seven fractional digits
    return {
        "shoal": _write(folder, "mine.csv", "arrival_s,input_tokens,output_tokens",
                        [f"{ROWS[i][0] + 10},{ROWS[i][1]},{ROWS[i][2]}" for i in order] + ["11,5,0"]),
        "azure": _write(folder, "AzureLLMInferenceTrace_conv.csv", "TIMESTAMP,ContextTokens,GeneratedTokens",
                        [f"{stamp.format(ROWS[i][0] + 40)},{ROWS[i][1]},{ROWS[i][2]}" for i in order]
                        + [f"{stamp.format(41)},0,3"]),
        "burstgpt": _write(folder, "BurstGPT_1.csv",
                           "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                           [f"{ROWS[i][0] + 5},ChatGPT,{ROWS[i][1]},{ROWS[i][2]},{ROWS[i][1] + ROWS[i][2]},"
                            "Conversation log" for i in order]
                           + ["6,GPT-4,120,0,120,Conversation log"]),  # a failed request: no response
        "mooncake": _write(folder, "mooncake_trace.jsonl", json.dumps(
            {"timestamp": int(ROWS[order[0]][0] * 1000), "input_length": ROWS[order[0]][1],
             "output_length": ROWS[order[0]][2], "hash_ids": [0, 1]}),
            [json.dumps({"timestamp": int(ROWS[i][0] * 1000), "input_length": ROWS[i][1],
                         "output_length": ROWS[i][2], "hash_ids": [0, 2]}) for i in order[1:]]
            + [json.dumps({"timestamp": 100, "input_length": 0, "output_length": 3, "hash_ids": []})]),
    }


@pytest.mark.parametrize("fmt", ["shoal", "azure", "burstgpt", "mooncake"])
def test_each_format_gives_the_same_requests_and_says_what_it_left_out(tmp_path: Path, fmt: str) -> None:
    path = _files(tmp_path)[fmt]
    trace = read_trace(path)
    assert trace.format.name == fmt and trace.num_dropped == 1
    workload = load_trace(path)
    got = [(round(r.arrival_s, 6), r.num_prompt_tokens, r.num_output_tokens) for r in workload.requests]
    assert got == ROWS
    assert workload.warnings == (f"1 rows of {path.name} have no prompt or no output tokens: left out",)
    if fmt == "shoal":
        assert "format" not in workload.description and workload.credit == ""
    else:
        assert f"({fmt} format)" in workload.description and workload.credit.startswith("Trace: ")
    scaled = load_trace(path, rate=2 * workload.mean_rate)
    assert scaled.requests[-1].arrival_s == pytest.approx(ROWS[-1][0] / 2)


def test_the_shipped_traces_read_as_before() -> None:
    conv = load_trace("azure-conv", num_requests=3)
    assert conv.credit == AZURE_CREDIT and conv.warnings == ()
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in conv.requests][:2] == [(374, 44), (396, 109)]


def test_unknown_columns_and_bad_rows_are_clear_errors(tmp_path: Path) -> None:
    other = _write(tmp_path, "other.csv", "time,prompt,completion", ["0,1,2"])
    with pytest.raises(ValueError, match=r"not a trace shoal reads .* azure: TIMESTAMP, ContextTokens"):
        read_trace(other)
    bad = _write(tmp_path, "bad.csv", "arrival_s,input_tokens,output_tokens", ["0,10,2", "1,ten,2"])
    with pytest.raises(ValueError, match=r"bad\.csv, line 3: cannot read a shoal row"):
        read_trace(bad)
    first = '{"timestamp": 0, "input_length": 5, "output_length": 2}'
    broken = _write(tmp_path, "broken.jsonl", first, ["{oops"])
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: not JSON"):
        read_trace(broken)


def test_shoal_simulate_runs_a_published_trace_and_credits_it(tmp_path: Path) -> None:
    path = _files(tmp_path)["burstgpt"]
    result = CliRunner().invoke(cli, ["simulate", "--trace", str(path), "--instances", "2"])
    assert result.exit_code == 0, result.output
    assert "BurstGPT_1.csv (burstgpt format)" in result.output
    assert "BurstGPT (Wang et al." in result.output
    assert "1 rows of BurstGPT_1.csv have no prompt or no output tokens: left out" in result.output
