"""``shoal bench prefix``'s figures: the agents' prefix-cache counters, one side's figures over
rounds, paired ratios, the live run against the simulator's prediction, the table and the plot."""

from __future__ import annotations

import contextlib
import re
import statistics
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CacheCounters",
    "combine_rounds",
    "compare_prediction",
    "fmt_ms",
    "fmt_rate",
    "median_known",
    "paired_ratios",
    "paired_to_reference",
    "parse_cache_counters",
    "plot_results",
    "results_table",
    "scrape_cache_counters",
]


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens looked up in the agents' prefix caches, and of those found cached (cumulative)."""

    queries: float
    hits: float

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries - other.queries, self.hits - other.hits)

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries + other.queries, self.hits + other.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


#: ``shoal_prefix_cache_queries_total`` (agents), ``vllm_prefix_cache_hits_total`` (vLLM's, ``:`` made
#: ``_``), ...: the counters themselves, not their ``_created`` timestamps
_COUNTER = re.compile(r"^(\w*prefix_cache_(queries|hits)(?:_total)?)(\{[^}]*\})?\s+(\S+)$", re.MULTILINE)


def parse_cache_counters(text: str) -> CacheCounters | None:
    """The prefix-cache query and hit counters of a ``/metrics`` page (summed over labels); None
    when the page has neither."""
    totals = {"queries": 0.0, "hits": 0.0}
    seen = False
    for _name, kind, _labels, value in _COUNTER.findall(text):
        with contextlib.suppress(ValueError):
            totals[kind] += float(value)
            seen = True
    return CacheCounters(totals["queries"], totals["hits"]) if seen else None


def scrape_cache_counters(urls: Sequence[str]) -> CacheCounters | None:
    """:func:`parse_cache_counters` of every agent's ``/metrics``, added up; None if one lacks them."""
    total = CacheCounters(0.0, 0.0)
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5.0) as response:
                counters = parse_cache_counters(response.read().decode())
        except OSError:
            return None
        if counters is None:
            return None
        total = total + counters
    return total


def paired_ratios(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each round's TTFT p50 and p99 without the cache over with it, and the medians of those ratios
    (rounds minutes apart see a machine of another speed; the sides of one round run back to back)."""
    if len(on) != len(off):
        raise ValueError(f"{len(on)} rounds with the cache against {len(off)} without")
    paired: dict[str, Any] = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_p50_later_turns_ms"):
        ratios = [b[key] / a[key] if a[key] else float("nan") for a, b in zip(on, off, strict=True)]
        name = key.removesuffix("_ms")
        paired[f"{name}_ratios"] = ratios
        paired[f"{name}_ratio"] = statistics.median(ratios) if ratios else float("nan")
    return paired


def median_known(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine_rounds(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's figures over rounds: the median of each round's figure; tokens and errors added up."""
    combined: dict[str, Any] = {"rounds": len(rounds)}
    for key in (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "ttft_p50_first_turn_ms",
        "ttft_p50_later_turns_ms",
        "hit_rate",
    ):
        combined[key] = median_known([r.get(key) for r in rounds])
    for key in ("requests", "errors", "prompt_tokens"):
        combined[key] = sum(int(r.get(key) or 0) for r in rounds)
    turns = sorted({t for r in rounds for t in r.get("ttft_p50_by_turn_ms", {})}, key=int)
    combined["ttft_p50_by_turn_ms"] = {
        t: median_known([r.get("ttft_p50_by_turn_ms", {}).get(t) for r in rounds]) for t in turns
    }
    combined["hit_rate_source"] = rounds[0].get("hit_rate_source") if rounds else None
    return combined


def results_table(names: Sequence[str], results: Mapping[str, Any], *, policies: bool) -> Any:
    """The sides' figures as a rich table (``policies``: the sides are dispatch policies)."""
    from rich.table import Table

    what = "prefix-cache-aware policies" if policies else "prefix cache on vs off"
    table = Table(title=f"shoal bench prefix: multi-turn sessions, {what} (medians of rounds)")
    for column in (
        ("policy" if policies else "cache"),
        "requests",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "first turn p50",
        "later turns p50",
        "hit rate",
    ):
        table.add_column(column, justify="left" if column == ("policy" if policies else "cache") else "right")
    for side in names:
        s = results[side]
        table.add_row(
            side,
            str(s["requests"]),
            str(s["errors"]),
            fmt_ms(s["ttft_p50_ms"]),
            fmt_ms(s["ttft_p99_ms"]),
            fmt_ms(s["ttft_p50_first_turn_ms"]),
            fmt_ms(s["ttft_p50_later_turns_ms"]),
            fmt_rate(s["hit_rate"]),
        )
    return table


def fmt_ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.0f}"


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def plot_results(names: Sequence[str], results: Mapping[str, Any], path: Path, *, policies: bool) -> None:
    """TTFT p50 by turn and the hit rate of each side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    styles = ("o-", "s--", "^:", "d-.", "v-")
    for index, side in enumerate(names):
        by_turn = results[side]["ttft_p50_by_turn_ms"]
        label = side if policies else f"cache {side}"
        left.plot([int(t) for t in by_turn], list(by_turn.values()), styles[index % len(styles)], label=label)
    left.set_xticks([int(t) for t in results[names[0]]["ttft_p50_by_turn_ms"]])
    left.set_xlabel("turn")
    left.set_ylabel("TTFT p50 (ms)")
    left.set_title("TTFT by turn")
    left.legend()
    rates = [100 * (results[side]["hit_rate"] or 0.0) for side in names]
    labels = list(names) if policies else [f"cache {side}" for side in names]
    right.bar(labels, rates, color=[f"C{k}" for k in range(len(labels))])
    right.set_ylabel("prompt tokens cached (%)")
    right.set_title("hit rate")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def paired_to_reference(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], names: Sequence[str]
) -> dict[str, Any]:
    """Per side after the first: each round's TTFT p50 (and p99, later turns' p50) over the first side's,
    and the medians of those ratios."""
    return {side: paired_ratios(runs[names[0]], runs[side]) for side in names[1:]}


def compare_prediction(
    live: Mapping[str, Mapping[str, Any]], predicted: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per policy: the live TTFT p50 of all turns pooled over rounds, the simulator's, and the
    prediction over live (and the same for p99 and the hit rate)."""
    table: dict[str, dict[str, Any]] = {}
    for policy, sim in predicted.items():
        pooled = live[policy]["pooled"]
        row: dict[str, Any] = {}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate"):
            live_value, sim_value = pooled.get(key), sim.get(key)
            row[f"live_{key}"], row[f"predicted_{key}"] = live_value, sim_value
            ok = live_value and sim_value is not None
            row[f"{key.removesuffix('_ms')}_predicted_over_live"] = sim_value / live_value if ok else None
        table[policy] = row
    return table
