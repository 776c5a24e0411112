"""``shoal agent``'s config (:mod:`agents.engines.agent_cli`) as the engines receive it: prefix caching is
on unless ``--no-prefix-cache`` (or ``SHOAL_PREFIX_CACHE=0``) says otherwise, and ``shoal up`` passes
the switch to every agent."""

from __future__ import annotations

import pytest

from agents.cli import _engine
from agents.engines.agent_cli import AgentCliConfig
from agents.engines.protocol import Engine
from bus.cli_config import from_argv, to_argv
from bus.options import NatsOptions
from frontend.up import UpConfig, agent_config
from schemas import SamplingParams


def _hits_of_a_repeated_prompt(engine: Engine) -> int:
    prompt = list(range(10, 60))
    for request_id in ("first", "again"):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return engine.stats().prefix_cache_hits


@pytest.mark.parametrize("engine", ["sim", "torch"])
def test_the_agents_engine_caches_prefixes_unless_told_not_to(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHOAL_PREFIX_CACHE", raising=False)
    base = ["--engine", engine, "--model", "tiny", "--num-blocks", "32"]
    on = from_argv(AgentCliConfig, base)
    off = from_argv(AgentCliConfig, [*base, "--no-prefix-cache"])
    assert on.prefix_cache and not off.prefix_cache
    assert _hits_of_a_repeated_prompt(_engine(on)) > 0
    assert _hits_of_a_repeated_prompt(_engine(off)) == 0
    monkeypatch.setenv("SHOAL_PREFIX_CACHE", "0")
    assert not from_argv(AgentCliConfig, base).prefix_cache


def test_shoal_up_passes_the_switch_to_every_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOAL_PREFIX_CACHE", raising=False)
    for engine in ("sim", "torch"):
        assert "--no-prefix-cache" in to_argv(
            agent_config(UpConfig(engine=engine, prefix_cache=False), NatsOptions(), "agent-0")
        )
        # rendered when on too: an agent's own SHOAL_PREFIX_CACHE cannot overrule shoal up
        assert "--prefix-cache" in to_argv(agent_config(UpConfig(engine=engine), NatsOptions(), "agent-0"))
    assert not from_argv(UpConfig, ["--no-prefix-cache"]).prefix_cache
