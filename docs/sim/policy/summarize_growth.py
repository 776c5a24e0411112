"""Round 4 panel: INFaaS++ vs the round-3 default vs round 4's (`shoal`: the move of queued
requests counts decode growth) vs `--dispatch blocks_ahead_growth` (growth in dispatch too).

Reads the sweep JSON of run.sh / run_shoal3.sh / run_shoal60.sh (INFaaS++ and the round-3
default, deterministic) and run_growth.sh (*_shoal4*, *_growth*; S-L's INFaaS++ and round-3 runs
in sl.json), prints a Markdown table of medians over the 3 seeds and writes them to
growth_panel.json.
Run from the repository root: `python docs/sim/policy/summarize_growth.py`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
METRICS = ("ttft_p99_s", "ttft_mean_s", "tpot_p99_s", "preemptions")
#: (label, rate, INFaaS++ file, round-3 file, file stem of the round-4 runs)
PANEL = [
    ("S-L", 5, "sl", "sl", "sl"),
    ("S-L", 6, "sl", "sl", "sl"),
    ("M-M", 11, "mm", "mm_shoal3", "mm"),
    ("M-M", 13, "mm", "mm_shoal3", "mm"),
    ("H100 azure-conv", 40, "azure_conv_h100", "azure_conv_h100_shoal3", "azure_conv_h100"),
    ("A10 azure-conv", 9, "azure_conv", "azure_conv_shoal3", "azure_conv"),
    ("A10 azure-conv", 10, "azure_conv", "azure_conv_shoal3", "azure_conv"),
    ("A10 azure-code", 4, "azure_code", "azure_code_shoal3", "azure_code"),
    ("A10 azure-code", 6, "azure_code", "azure_code_shoal3", "azure_code"),
    ("M-M 10% high", 12, "priorities_mm", "priorities_mm_shoal3", "priorities_mm"),
]
NAMES = ("INFaaS++", "round 3", "round 4", "growth dispatch")
#: Every point of the Must-show tables that round 4 was run at: (label, INFaaS++ file, stem)
EVERY = [
    ("A10 azure-conv", "azure_conv", "azure_conv"),
    ("A10 azure-code", "azure_code", "azure_code"),
    ("M-M", "mm", "mm"),
    ("M-M 10% high", "priorities_mm", "priorities_mm"),
    ("H100 azure-conv", "azure_conv_h100", "azure_conv_h100"),
    ("H100 azure-code", "azure_code_h100", "azure_code_h100"),
]


def medians(prefix: str, policy: str, rate: float, dispatch: str | None = None) -> dict[str, float] | None:
    """Medians over seeds of ``policy`` (and its dispatch rule) at ``rate`` in ``prefix``.json."""
    path = HERE / f"{prefix}.json"
    if not path.exists():
        return None
    runs = [
        r for r in json.loads(path.read_text())
        if r["policy"] == policy and r["rate"] == rate
        and (dispatch is None or r["parameters"].get("dispatch") == dispatch)
    ]
    if not runs:
        return None
    out = {m: statistics.median(r[m] for r in runs) for m in METRICS}
    out["seeds"] = len(runs)
    return out


def _cell(values: tuple[dict[str, float], ...], metric: str, digits: int) -> str:
    return " / ".join(f"{v[metric]:.{digits}f}" for v in values)


def main() -> None:
    rows = []
    columns = " / ".join(NAMES)
    print(
        f"| trace | rate | P99 TTFT s ({columns}) | mean TTFT s | P99 TPOT s | preemptions "
        "| round 4 vs INFaaS++: P99 TTFT / mean / TPOT |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, rate, infaas_file, old_file, stem in PANEL:
        found = (
            medians(infaas_file, "infaas", rate),
            medians(old_file, "shoal", rate, "blocks_ahead"),
            medians(f"{stem}_shoal4", "shoal", rate, "blocks_ahead"),
            medians(f"{stem}_growth", "shoal", rate, "blocks_ahead_growth"),
        )
        rows.append({"trace": label, "rate": rate, **dict(zip(NAMES, found, strict=True))})
        if any(v is None for v in found):
            print(f"| {label} | {rate} | (not run yet) |")
            continue
        values = tuple(v for v in found if v is not None)
        infaas, new = values[0], values[2]
        p99 = infaas["ttft_p99_s"] / new["ttft_p99_s"]
        mean = new["ttft_mean_s"] / infaas["ttft_mean_s"]
        tpot = new["tpot_p99_s"] / infaas["tpot_p99_s"]
        print(
            f"| {label} | {rate} | {_cell(values, 'ttft_p99_s', 2)} | {_cell(values, 'ttft_mean_s', 2)} "
            f"| {_cell(values, 'tpot_p99_s', 3)} | {_cell(values, 'preemptions', 0)} "
            f"| {p99:.2f}x / {mean:.2f}x / {tpot:.2f}x |"
        )
    (HERE / "growth_panel.json").write_text(json.dumps(rows, indent=1) + "\n")
    every()


def every() -> None:
    """Round 4 against INFaaS++ and round 3 at every point it was run (ratios as the Must-show list)."""
    print()
    print(
        "| trace | rate | P99 TTFT INFaaS++/round 4 (round 3) | mean TTFT round 4/INFaaS++ (round 3) "
        "| P99 TPOT round 4/INFaaS++ (round 3) |"
    )
    print("|---|---|---|---|---|")
    for label, infaas_file, stem in EVERY:
        path = HERE / f"{stem}_shoal4.json"
        if not path.exists():
            continue
        for rate in sorted({r["rate"] for r in json.loads(path.read_text())}):
            infaas = medians(infaas_file, "infaas", rate)
            old = medians(f"{stem}_shoal3", "shoal", rate, "blocks_ahead")
            new = medians(f"{stem}_shoal4", "shoal", rate, "blocks_ahead")
            if infaas is None or new is None or old is None:
                continue
            p99 = (infaas["ttft_p99_s"] / new["ttft_p99_s"], infaas["ttft_p99_s"] / old["ttft_p99_s"])
            mean = (new["ttft_mean_s"] / infaas["ttft_mean_s"], old["ttft_mean_s"] / infaas["ttft_mean_s"])
            tpot = (new["tpot_p99_s"] / infaas["tpot_p99_s"], old["tpot_p99_s"] / infaas["tpot_p99_s"])
            cells = " | ".join(f"{a:.2f}x ({b:.2f}x)" for a, b in (p99, mean, tpot))
            print(f"| {label} | {rate:g} | {cells} |")


if __name__ == "__main__":
    main()
