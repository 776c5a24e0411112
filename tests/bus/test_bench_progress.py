"""A benchmark's progress lines: one per phase, counted, timed, with the time left, on the console given."""

from __future__ import annotations

import io

from rich.console import Console

from bus.bench_progress import BenchProgress


def _progress(total: int | None) -> tuple[BenchProgress, io.StringIO, list[float]]:
    out = io.StringIO()
    now = [100.0]
    console = Console(file=out, width=200, color_system=None, soft_wrap=True)
    return BenchProgress("demo", total, console=console, clock=lambda: now[0]), out, now


def test_each_phase_is_one_line_with_its_count_elapsed_time_and_time_left() -> None:
    progress, out, now = _progress(4)
    progress.phase("start [the] servers")  # brackets are text, not markup
    now[0] += 30
    progress.phase("run 1")
    now[0] += 30
    progress.note("p99 12 ms")
    progress.phase("run 2")
    progress.finish()
    assert out.getvalue().splitlines() == [
        "bench demo [1/4 0:00] start [the] servers",
        "bench demo [2/4 0:30, ~1:30 left] run 1",
        "bench demo [1:00] p99 12 ms",
        "bench demo [3/4 1:00, ~1:00 left] run 2",
        "bench demo [1:00] done",
    ]


def test_an_unknown_number_of_phases_is_counted_without_an_estimate() -> None:
    progress, out, now = _progress(None)
    progress.phase("a")
    now[0] += 75
    progress.phase("b")
    assert out.getvalue().splitlines() == ["bench demo [1 0:00] a", "bench demo [2 1:15] b"]


def test_the_lines_go_to_stderr_by_default(capsys: object) -> None:
    BenchProgress("demo", 1).phase("only")
    captured = capsys.readouterr()  # type: ignore[attr-defined]
    assert captured.out == ""
    assert "bench demo [1/1 0:00] only" in captured.err
