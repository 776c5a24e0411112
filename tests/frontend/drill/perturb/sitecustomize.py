"""A broken sim engine, for the drill test that shows the greedy-text verdict can fail.

With this folder on ``PYTHONPATH`` and ``SHOAL_TEST_BREAK_SIM_TOKENS=1``, every Python process
(the drill's agents among them) imports this module at start-up, and its sim engines sample a
request that arrives mid-stream (migrated in, or rescued with tokens already generated) with the
wrong key: from there on its tokens are those of a request of another id. The answer keeps its
length and ends normally, with other text.
"""

from __future__ import annotations

import os

if os.environ.get("SHOAL_TEST_BREAK_SIM_TOKENS") == "1":
    from typing import Any

    from agents.engines import sim

    _sample = sim.SimEngine._sample

    def _broken_sample(self: sim.SimEngine, plan: Any) -> dict[str, int]:
        for request in [p.request for p in plan.prefills] + plan.decodes:
            request_id = request.request_id
            mid_stream = len(request.all_token_ids) > request.num_prompt_tokens
            if request_id not in self._token_keys and mid_stream:
                self._token_keys[request_id] = sim._request_key(f"{request_id}-wrong", request.sampling.seed)
        return _sample(self, plan)

    sim.SimEngine._sample = _broken_sample  # type: ignore[method-assign]
