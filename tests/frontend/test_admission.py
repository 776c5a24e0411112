"""Admission control: slots against the limit, the 429 a client sees past it, and no leaked slots."""

from __future__ import annotations

import pytest

from frontend.admission import Admission
from frontend.errors import APIError
from frontend.metrics import FrontendMetrics
from tests.frontend.cluster import frontend_cluster


def _metric(metrics: FrontendMetrics, line_start: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not exported")


def test_admits_up_to_the_limit_then_answers_429_with_retry_after() -> None:
    metrics = FrontendMetrics()
    admission = Admission(2, retry_after_s=3, metrics=metrics)
    admission.admit()
    admission.admit()
    assert admission.num_in_flight == 2 and admission.is_full
    with pytest.raises(APIError) as refused:
        admission.admit()
    error = refused.value
    assert error.status == 429 and error.headers == {"Retry-After": "3"}
    assert error.body()["error"]["code"] == "rate_limit_exceeded"
    assert admission.num_in_flight == 2  # a refusal takes no slot
    assert _metric(metrics, "shoal_requests_in_flight") == 2.0
    assert _metric(metrics, 'shoal_rejected_total{status="429"}') == 1.0


def test_a_released_slot_can_be_taken_again() -> None:
    metrics = FrontendMetrics()
    admission = Admission(1, retry_after_s=1, metrics=metrics)
    admission.admit()
    admission.release()
    assert admission.num_in_flight == 0 and not admission.is_full
    assert _metric(metrics, "shoal_requests_in_flight") == 0.0
    admission.admit()
    assert admission.num_in_flight == 1


def test_release_without_admit_is_a_bug_not_a_negative_count() -> None:
    admission = Admission(1, retry_after_s=1, metrics=FrontendMetrics())
    with pytest.raises(RuntimeError):
        admission.release()
    with pytest.raises(ValueError):
        Admission(0, retry_after_s=1, metrics=FrontendMetrics())


async def test_refused_and_unplaced_requests_give_their_slot_back(nats_url: str) -> None:
    """With one slot: a 400 and a 503 (no instance) leave it free, so the next request is not a 429."""
    async with frontend_cluster(nats_url, instances=0, max_concurrent_requests=1) as cluster, \
            cluster.client() as client:
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 2}
        invalid = await client.post("/v1/completions", json={**body, "best_of": 2})
        assert invalid.status_code == 400
        for path, request in (("/v1/completions", body),
                              ("/v1/chat/completions",
                               {"model": "sim:tiny-test", "messages": [{"role": "user", "content": "hi"}]})):
            for _ in range(2):
                refused = await client.post(path, json=request)
                assert refused.status_code == 503, refused.text
                assert "retry-after" in refused.headers
        metrics = (await client.get("/metrics")).text
        assert "shoal_requests_in_flight 0.0" in metrics
        assert 'shoal_rejected_total{status="429"}' not in metrics
