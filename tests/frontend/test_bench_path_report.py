"""``shoal bench path-cpu``'s arithmetic: variants, per-request figures, medians, paired ratios, tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from frontend.bench_path_report import (
    medians,
    paired_ratios,
    parse_variant,
    parse_variants,
    progress_line,
    rotation,
    run_figures,
    subject_pattern,
    subjects_table,
    summarize,
    table,
)
from frontend.bench_path_sim import bench_path_cpu

ROOT = Path(__file__).resolve().parents[2]


def test_a_variant_is_a_name_and_an_absolute_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_variant("base=/tmp/base") == ("base", Path("/tmp/base"))
    assert parse_variant("cuts=.") == ("cuts", tmp_path.resolve())
    assert parse_variant("a=b=c") == ("a", (tmp_path / "b=c").resolve())  # the first '=' splits
    for bad in ("base", "=/tmp/base", "base=", "two words=/tmp", "x/y=/tmp"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_no_variant_is_this_tree_and_a_name_given_twice_is_refused() -> None:
    assert parse_variants((), ROOT) == [("this", ROOT)]
    assert [name for name, _ in parse_variants(("b=/x", "a=/y"), ROOT)] == ["b", "a"]  # order kept
    with pytest.raises(ValueError, match="twice: a"):
        parse_variants(("a=/x", "b=/y", "a=/z"), ROOT)


def test_rounds_alternate_which_variant_goes_first() -> None:
    assert [rotation(["a", "b", "c"], index) for index in range(3)] == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]


def test_subjects_per_request_or_frontend_are_counted_under_one_pattern() -> None:
    assert subject_pattern("shoal.ev.req.r-123") == "shoal.ev.req.*"
    assert subject_pattern("shoal.tokb.f-1") == "shoal.tokb.*"
    assert subject_pattern("shoal.tok.r-9") == "shoal.tok.*"
    assert subject_pattern("shoal.ev.mig.m1") == "shoal.ev.mig.*"
    assert subject_pattern("_INBOX.abc.def") == "<reply>"
    assert subject_pattern("$JS.ACK.shoal_events.c.1.2.3.4.5") == "<reply>"
    assert subject_pattern("shoal.rpc.sched.dispatch") == "shoal.rpc.sched.dispatch"
    assert subject_pattern("shoal.load.a0") == "shoal.load.a0"  # one agent: kept by name


def test_a_runs_counters_become_cpu_ms_and_messages_per_request_and_token() -> None:
    delta = {
        "frontend": 1.6,
        "scheduler": 0.2,
        "agent": 0.4,
        "nats": 0.3,
        "bus_in_msgs": 3000.0,
        "bus_out_msgs": 4200.0,
    }
    figures = run_figures(delta, requests=200, output_tokens=200 * 128)
    assert figures["cpu_frontend_ms"] == pytest.approx(8.0)
    assert figures["cpu_scheduler_ms"] == pytest.approx(1.0)
    assert figures["cpu_all_ms"] == pytest.approx(12.5)
    assert figures["bus_in_msgs_per_request"] == pytest.approx(15.0)
    assert figures["bus_out_msgs_per_token"] == pytest.approx(4200 / 25600)
    # without a scheduler the sum is of the processes there are
    alone = run_figures({"frontend": 1.0, "agent": 1.0, "nats": 0.5}, requests=100, output_tokens=100)
    assert "cpu_scheduler_ms" not in alone and alone["cpu_all_ms"] == pytest.approx(25.0)
    with pytest.raises(ValueError):
        run_figures(delta, requests=0, output_tokens=1)


def test_medians_are_over_rounds_of_the_figures_every_round_has() -> None:
    rounds = [
        {"cpu_frontend_ms": 8.0, "ttft_p50_ms": 30.0},
        {"cpu_frontend_ms": 10.0},
        {"cpu_frontend_ms": 9.0},
    ]
    assert medians(rounds) == {"cpu_frontend_ms": 9.0}
    assert medians([]) == {}


def test_paired_ratios_divide_each_round_by_the_reference_in_the_same_round() -> None:
    reference = [
        {"cpu_frontend_ms": 10.0, "cpu_scheduler_ms": 0.0},
        {"cpu_frontend_ms": 8.0, "cpu_scheduler_ms": 1.0},
    ]
    new = [
        {"cpu_frontend_ms": 8.0, "cpu_scheduler_ms": 1.0},
        {"cpu_frontend_ms": 7.2, "cpu_scheduler_ms": 1.0},
    ]
    ratios = paired_ratios(new, reference)
    assert ratios["cpu_frontend_ms"] == pytest.approx({"median": 0.85, "low": 0.8, "high": 0.9})
    assert "cpu_scheduler_ms" not in ratios  # a round with nothing to divide by
    with pytest.raises(ValueError):  # rounds that do not pair up
        paired_ratios(new, reference[:1])


RUNS = {
    "base": {
        "stream": [
            {"cpu_frontend_ms": 10.0, "ttft_p50_ms": 40.0},
            {"cpu_frontend_ms": 12.0, "ttft_p50_ms": 44.0},
        ]
    },
    "new": {
        "stream": [
            {"cpu_frontend_ms": 8.0, "ttft_p50_ms": 40.0},
            {"cpu_frontend_ms": 10.8, "ttft_p50_ms": 44.0},
        ]
    },
}


def test_the_summary_and_table_compare_every_later_variant_with_the_first() -> None:
    summary = summarize(RUNS)
    assert "paired" not in summary["base"]["stream"]
    assert summary["new"]["stream"]["medians"] == {"cpu_frontend_ms": 9.4, "ttft_p50_ms": 42.0}
    paired = summary["new"]["stream"]["paired"]
    assert isinstance(paired, dict) and paired["cpu_frontend_ms"]["median"] == pytest.approx(0.85)
    text = table(RUNS, 2)
    lines = text.splitlines()
    assert "medians of 2 round(s)" in lines[0]
    assert "11.00" in lines[2] and "9.40" in lines[3] and "0.85x" in lines[4] and "vs base" in lines[4]
    assert "42.00" in lines[2]  # TTFT p50
    assert " - " in lines[2]  # the scheduler's column: not measured


def test_subject_counts_are_medians_of_rounds_most_first() -> None:
    counts = {
        "this": {
            "stream": [
                {"a.tokb.*": 4.0, "<reply>": 1.0},
                {"a.tokb.*": 5.0},
                {"a.tokb.*": 6.0, "<reply>": 2.0},
            ]
        }
    }
    lines = subjects_table(counts).splitlines()
    assert lines[1].split() == ["stream", "this", "5.00", "a.tokb.*"]
    assert lines[2].split() == ["stream", "this", "1.00", "<reply>"]  # missing from a round: 0 there


def test_a_progress_line_names_each_process_measured() -> None:
    line = progress_line(
        "stream", "new", {"cpu_frontend_ms": 8.1, "cpu_agent_ms": 1.9, "bus_in_msgs_per_request": 15.1}
    )
    assert "frontend 8.10" in line and "agent 1.90" in line and "scheduler" not in line and "in 15.1" in line


def test_the_command_refuses_a_bad_variant_before_it_starts_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(bench_path_cpu, ["--variant", "nameonly"])
    assert result.exit_code == 2 and "NAME=SOURCE_TREE" in result.output
    result = runner.invoke(bench_path_cpu, ["--variant", f"empty={tmp_path}"])
    assert result.exit_code == 2 and "holds no frontend/cli.py" in result.output
    result = runner.invoke(bench_path_cpu, ["--variant", f"a={ROOT}", "--variant", f"a={ROOT}"])
    assert result.exit_code == 2 and "twice" in result.output


def test_the_load_is_the_same_prompts_every_time_within_the_tokenizer(tmp_path: Path) -> None:
    from agents.engines.vllm_engine.checkpoint import _tokenizer
    from frontend.bench_path_sim import LoadOptions, build_prompts

    _tokenizer(tmp_path, 512)  # the small random checkpoint's tokenizer, alone
    ids = LoadOptions(5, 16, 4, 2, token_ids=True, subjects=False, client_timeout_s=1.0)
    first = build_prompts(tmp_path, ids)
    assert first == build_prompts(tmp_path, ids) and len(first) == 5
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size()
    assert all(isinstance(p, list) and len(p) == 16 and all(3 <= t < size for t in p) for p in first)
    texts = build_prompts(
        tmp_path, LoadOptions(5, 16, 4, 2, token_ids=False, subjects=False, client_timeout_s=1.0)
    )
    assert all(isinstance(text, str) and text for text in texts) and len(set(texts)) == 5
