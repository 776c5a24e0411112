"""Workloads: trace loading and scaling, synthetic arrivals and power-law lengths, priorities."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.sim.workload import (
    AZURE_CREDIT,
    build_workload,
    gamma_arrivals,
    load_trace,
    power_law_exponent,
    power_law_lengths,
    synthetic_workload,
    with_priorities,
)


@pytest.mark.parametrize("mean", [128.0, 256.0, 512.0])
def test_power_law_lengths_have_the_papers_means_and_cap(mean: float) -> None:
    lengths = power_law_lengths(200_000, mean, np.random.default_rng(3))
    assert lengths.min() >= 1 and lengths.max() <= 6000
    assert abs(lengths.mean() - mean) / mean < 0.03
    assert np.median(lengths) < mean  # heavy-tailed: most requests are short


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=2.0, max_value=2500.0))
def test_power_law_exponent_falls_as_the_mean_grows(mean: float) -> None:
    assert power_law_exponent(mean) > power_law_exponent(mean + 100.0)


@pytest.mark.parametrize("cv", [1.0, 2.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_burstiness_asked_for(cv: float) -> None:
    arrivals = gamma_arrivals(100_000, 5.0, cv, np.random.default_rng(1))
    gaps = np.diff(arrivals)
    assert abs(gaps.mean() - 0.2) / 0.2 < 0.05
    assert abs(gaps.std() / gaps.mean() - cv) / cv < 0.1


def test_azure_trace_is_time_scaled_to_a_rate_and_credited() -> None:
    natural = load_trace("azure-conv", num_requests=2000)
    faster = load_trace("azure-conv", num_requests=2000, rate=3 * natural.mean_rate)
    assert faster.mean_rate == pytest.approx(3 * natural.mean_rate)
    assert [r.num_prompt_tokens for r in faster.requests] == [r.num_prompt_tokens for r in natural.requests]
    assert faster.requests[0].arrival_s == 0.0
    assert faster.credit == AZURE_CREDIT and "Azure" in faster.credit
    code = load_trace("azure-code", num_requests=100, start=50)
    assert len(code.requests) == 100 and code.requests[0].arrival_s == 0.0


def test_synthetic_mixes_put_long_lengths_where_the_mix_says() -> None:
    ls = synthetic_workload(20_000, 10.0, mix="L-S", seed=2)
    prompts = np.array([r.num_prompt_tokens for r in ls.requests])
    outputs = np.array([r.num_output_tokens for r in ls.requests])
    assert prompts.mean() > 3 * outputs.mean()
    assert ls.mean_rate == pytest.approx(10.0, rel=0.05)
    assert synthetic_workload(50, 1.0, seed=9) == synthetic_workload(50, 1.0, seed=9)


def test_priorities_go_to_the_share_asked_for() -> None:
    base = synthetic_workload(20_000, 10.0, mix="S-S", seed=1)
    mixed = with_priorities(base, 0.1, seed=1)
    share = sum(1 for r in mixed.requests if r.priority < 0) / len(mixed.requests)
    assert share == pytest.approx(0.1, abs=0.01)
    assert "10% high priority" in mixed.description


def test_build_workload_names_traces_and_mixes() -> None:
    assert "synthetic S-L" in build_workload("S-L", num_requests=10, rate=1.0).description
    assert "azure-code" in build_workload("azure-code", num_requests=10).description
    with pytest.raises(ValueError, match="needs a rate"):
        build_workload("M-M", num_requests=10)
    with pytest.raises(ValueError, match="no trace"):
        build_workload("nope.csv", num_requests=10)


def test_a_trace_shorter_than_asked_is_announced() -> None:
    whole = load_trace("azure-code")
    assert whole.warnings == ()
    asked = len(whole.requests) + 500
    truncated = load_trace("azure-code", num_requests=asked)
    assert len(truncated.requests) == len(whole.requests)
    assert truncated.warnings == (
        f"trace truncated: {asked} requests asked for, the trace has {len(whole.requests)} usable rows "
        f"from row 0; simulating {len(whole.requests)}",
    )
    assert load_trace("azure-code", num_requests=100).warnings == ()
