"""Round 8's table (docs/SIMULATION.md): `prefill_ahead_saturated` beside round 6's default
(`prefill_ahead`, docs/sim/policy5), medians of 3 seeds. INFaaS++ is docs/sim/policy4's runs.

python docs/sim/policy8/compact.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).parent
ROUND6 = HERE.parent / "policy5"
# round 6's script reads the runs and makes the cells alike
_spec = importlib.util.spec_from_file_location("round6_compact", ROUND6 / "compact.py")
assert _spec is not None and _spec.loader is not None
_round6 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_round6)


def main() -> None:
    print("| sweep | knee (INFaaS++) | rate | round 8 (`prefill_ahead_saturated`): P99 TTFT INFaaS++/shoal, "
          "mean TTFT and P99 TPOT shoal/INFaaS++ | round 6 (`prefill_ahead`): the same "
          "| P99 TTFT s: INFaaS++ / round 6 / round 8 | same decisions |")
    print("|---|---|---|---|---|---|---|")
    keys = ("ttft_p99_s", "ttft_mean_s", "tpot_p99_s")
    for cells, old, cand in _round6.rows(HERE, ROUND6):
        print(f"{cells} {'yes' if all(old[key] == cand[key] for key in keys) else ''} |")


if __name__ == "__main__":
    main()
