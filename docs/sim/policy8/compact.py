"""Round 8's table (docs/SIMULATION.md): `prefill_ahead_saturated` beside round 6's default
(`prefill_ahead`, docs/sim/policy5), medians of 3 seeds. INFaaS++ is docs/sim/policy4's runs.

python docs/sim/policy8/compact.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scheduler.sim.sweep import knee

HERE = Path(__file__).parent
BASELINES = HERE.parent / "policy4"
ROUND6 = HERE.parent / "policy5"
# round 6's script names the sweeps and reads the files alike
_spec = importlib.util.spec_from_file_location("round6_compact", ROUND6 / "compact.py")
assert _spec is not None and _spec.loader is not None
_round6 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_round6)
NAMES, _shoal, _cell = _round6.NAMES, _round6._shoal, _round6._cell


def main() -> None:
    print("| sweep | knee (INFaaS++) | rate | round 8 (`prefill_ahead_saturated`): P99 TTFT INFaaS++/shoal, "
          "mean TTFT and P99 TPOT shoal/INFaaS++ | round 6 (`prefill_ahead`): the same "
          "| P99 TTFT s: INFaaS++ / round 6 / round 8 | same decisions |")
    print("|---|---|---|---|---|---|---|")
    for stem, name in NAMES.items():
        new = HERE / f"{stem}_default-median.json"
        if not new.exists():
            continue
        runs = json.loads((BASELINES / f"{stem}-median.json").read_text())
        base = [p for p in runs if p["policy"] != "shoal"]
        infaas = {float(p["rate"]): p for p in base if p["policy"] == "infaas"}
        old, cand = _shoal(ROUND6 / f"{stem}_default-median.json"), _shoal(new)
        k = knee(base, str(base[0]["workload"]), "infaas")
        for rate in sorted(cand):
            i = infaas[rate]
            c_text, c_ok = _cell(i, cand[rate])
            o_text, o_ok = _cell(i, old[rate])
            mark = "" if c_ok else "**"
            old_mark = "" if o_ok else "**"
            first = rate == min(cand)
            knee_text = f"{k:g}" if first and k is not None else ""
            seconds = " / ".join(f"{x['ttft_p99_s']:.2f}" for x in (i, old[rate], cand[rate]))
            keys = ("ttft_p99_s", "ttft_mean_s", "tpot_p99_s")
            same = "yes" if all(old[rate][key] == cand[rate][key] for key in keys) else ""
            print(f"| {name if first else ''} | {knee_text} | {rate:g}{' (knee)' if rate == k else ''} "
                  f"| {mark}{c_text}{mark} | {old_mark}{o_text}{old_mark} | {seconds} | {same} |")


if __name__ == "__main__":
    main()
