"""``shoal bench path-cpu``'s arithmetic: variants, one run's figures, medians, paired ratios, the table.

Pure: no processes, no sockets. The cluster and the load are in :mod:`frontend.bench_path_sim`;
the ``/proc`` and ``/varz`` readers in :mod:`frontend.bench_path_cpu`.

A run is one load (``requests`` completions, streamed or whole) against one variant's cluster;
its figures are a flat mapping: ``cpu_<process>_ms`` (CPU milliseconds per request of the
frontend, the scheduler, the agent and nats-server), ``cpu_all_ms`` (their sum), the bus
messages per request and per output token (``bus_in_msgs_per_request``, ...), ``ttft_p50_ms``
(streamed) and ``wall_s``. A round runs every variant once per mode; medians are over rounds,
and a variant is compared to the first one by the median of its paired ratios (same round, same
mode).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from frontend.bench_path_cpu import per_request

__all__ = [
    "CPU_PROCESSES",
    "Variant",
    "medians",
    "paired_ratios",
    "parse_variant",
    "parse_variants",
    "progress_line",
    "rotation",
    "run_figures",
    "subject_pattern",
    "subjects_table",
    "summarize",
    "table",
]

#: the processes whose CPU is reported, in the table's order
CPU_PROCESSES = ("frontend", "scheduler", "agent", "nats")

Variant = tuple[str, Path]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def parse_variant(text: str) -> Variant:
    """``NAME=SOURCE_TREE`` -> (name, absolute path). ValueError on a missing ``=``, a name that is
    not a plain word (letters, digits, ``_.-``) or an empty tree."""
    name, sep, tree = text.partition("=")
    if not sep or not tree:
        raise ValueError(f"{text!r}: expected NAME=SOURCE_TREE")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{text!r}: the name must be letters, digits, '_', '.' or '-'")
    return name, Path(tree).expanduser().resolve()


def parse_variants(texts: Sequence[str], default_tree: Path) -> list[Variant]:
    """Every ``--variant`` (the first is the reference of the paired ratios); none given: this
    tree alone, named ``this``. ValueError on a name given twice."""
    if not texts:
        return [("this", default_tree)]
    variants = [parse_variant(text) for text in texts]
    names = [name for name, _ in variants]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"variant name given twice: {', '.join(twice)}")
    return variants


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order the variants run in a round: as given in even rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


_REPLY = re.compile(r"^(_INBOX\.|\$JS\.ACK\.)")
_PER_ID = re.compile(r"^([\w-]+\.(?:ev\.req|ev\.mig|tok|tokb))\.[^.]+$")


def subject_pattern(subject: str) -> str:
    """The pattern a subject is counted under: replies (``_INBOX.…``, JetStream acks) as ``<reply>``,
    a subject per request or per frontend (``<prefix>.ev.req.<id>``, ``tok``, ``tokb``,
    ``ev.mig``) with ``*`` for the id; others as they are."""
    if _REPLY.match(subject):
        return "<reply>"
    return _PER_ID.sub(r"\1.*", subject)


def run_figures(delta: Mapping[str, float], *, requests: int, output_tokens: int) -> dict[str, float]:
    """One run's figures from what the counters gained over it: CPU seconds by process (``frontend``,
    ``scheduler``, ``agent``, ``nats``) and the nats-server's ``bus_in_msgs``/``bus_out_msgs``."""
    figures = per_request(delta, requests, output_tokens)
    figures["cpu_all_ms"] = sum(figures.get(f"cpu_{name}_ms", 0.0) for name in CPU_PROCESSES)
    return figures


def medians(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median over ``runs`` of every figure all of them have."""
    if not runs:
        return {}
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    return {key: statistics.median(run[key] for run in runs) for key in keys}


def paired_ratios(
    runs: Sequence[Mapping[str, float]], reference: Sequence[Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Each figure's ratio to the reference's in the same round: median, lowest and highest
    (figures the reference has at 0 in some round, or either side lacks, left out)."""
    pairs = list(zip(runs, reference, strict=True))
    if not pairs:
        return {}
    ratios: dict[str, dict[str, float]] = {}
    for key in runs[0]:
        values = [run[key] / ref[key] for run, ref in pairs if key in run and ref.get(key)]
        if len(values) == len(pairs):
            ratios[key] = {"median": statistics.median(values), "low": min(values), "high": max(values)}
    return ratios


Runs = Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]]


def summarize(runs: Runs) -> dict[str, dict[str, dict[str, object]]]:
    """``runs[variant][mode]`` (rounds in order) -> per variant and mode its ``medians`` and, for
    every variant after the first, its ``paired`` ratios to the first."""
    names = list(runs)
    summary: dict[str, dict[str, dict[str, object]]] = {}
    for name in names:
        summary[name] = {}
        for mode, rounds in runs[name].items():
            entry: dict[str, object] = {"medians": medians(rounds)}
            if name != names[0]:
                entry["paired"] = paired_ratios(rounds, runs[names[0]][mode])
            summary[name][mode] = entry
    return summary


_COLUMNS = (
    ("frontend", "cpu_frontend_ms"),
    ("scheduler", "cpu_scheduler_ms"),
    ("agent", "cpu_agent_ms"),
    ("nats", "cpu_nats_ms"),
    ("all", "cpu_all_ms"),
    ("bus in/req", "bus_in_msgs_per_request"),
    ("out/req", "bus_out_msgs_per_request"),
    ("TTFT p50", "ttft_p50_ms"),
)


def _cell(values: Mapping[str, float], key: str, ratio: bool) -> str:
    if key not in values:
        return "-"
    return f"{values[key]:.2f}x" if ratio else f"{values[key]:.2f}"


def table(runs: Runs, rounds: int) -> str:
    """CPU ms per request per process (medians of ``rounds``), bus messages per request and the
    streamed TTFT; below each later variant its paired ratios to the first."""
    names = list(runs)
    summary = summarize(runs)
    head = f"{'mode':>7} {'variant':>14} " + " ".join(f"{title:>10}" for title, _ in _COLUMNS)
    lines = [f"CPU ms per request by process, medians of {rounds} round(s) (-: not there)", head]
    for mode in runs[names[0]]:
        for name in names:
            entry = summary[name][mode]
            values = entry["medians"]
            assert isinstance(values, dict)
            lines.append(
                f"{mode:>7} {name:>14} " + " ".join(f"{_cell(values, k, False):>10}" for _, k in _COLUMNS)
            )
            paired = entry.get("paired")
            if isinstance(paired, dict):
                ratios = {key: value["median"] for key, value in paired.items()}
                label = f"vs {names[0]}"[:14]
                lines.append(
                    f"{'':>7} {label:>14} " + " ".join(f"{_cell(ratios, k, True):>10}" for _, k in _COLUMNS)
                )
    return "\n".join(lines)


def progress_line(mode: str, name: str, figures: Mapping[str, float]) -> str:
    """One run's line as it finishes: CPU ms per request by process and bus messages per request."""
    cpu = " ".join(
        f"{process} {figures[f'cpu_{process}_ms']:.2f}"
        for process in CPU_PROCESSES
        if f"cpu_{process}_ms" in figures
    )
    bus_in, bus_out = (
        figures.get("bus_in_msgs_per_request", 0.0),
        figures.get("bus_out_msgs_per_request", 0.0),
    )
    bus = f"in {bus_in:.1f} out {bus_out:.1f}"
    return f"{mode:6} {name:>14}: CPU ms/request {cpu}; bus messages/request {bus}"


def subjects_table(by_subject: Runs) -> str:
    """Bus messages per request by subject pattern, medians of the rounds (a pattern missing from a
    round counts 0 there), most first."""
    lines = ["bus messages per request by subject (medians of rounds)"]
    for name, modes in by_subject.items():
        for mode, rounds in modes.items():
            keys = {key for counts in rounds for key in counts}
            rows = {key: statistics.median(counts.get(key, 0.0) for counts in rounds) for key in keys}
            for key, value in sorted(rows.items(), key=lambda row: (-row[1], row[0])):
                lines.append(f"{mode:>7} {name:>14} {value:8.2f}  {key}")
    return "\n".join(lines)
