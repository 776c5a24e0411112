"""A seeded long-context trace in Mooncake's JSON-lines format, for a check no shipped trace covers.

Not a real trace: prompts log-normal (median 5,000 tokens, sigma 0.9, capped at 100k; mean ~7.7k,
p99 ~41k), outputs log-normal (median 250, sigma 0.8, capped at 3,000), Gamma arrivals with CV 2
at 1 req/s (``shoal simulate`` rescales them to each rate). The shape follows published long-context
traces (Mooncake's prompts average ~7.6k tokens), not their values.

    python docs/sim/long-context/make_trace.py /tmp/longctx.jsonl
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(path: str, num: int = 8000, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(0.25, 1 / (1.0 * 0.25), size=num)  # shape 1/CV^2, mean 1 s
    arrivals = np.cumsum(gaps)
    arrivals -= arrivals[0]
    prompts = np.minimum(np.exp(rng.normal(np.log(5000), 0.9, size=num)), 100_000).astype(int) + 50
    outputs = np.minimum(np.exp(rng.normal(np.log(250), 0.8, size=num)), 3000).astype(int) + 1
    with open(path, "w") as handle:
        for at, prompt, output in zip(arrivals, prompts, outputs, strict=True):
            row = {"timestamp": int(at * 1000), "input_length": int(prompt), "output_length": int(output)}
            handle.write(json.dumps({**row, "hash_ids": []}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "longctx.jsonl")
