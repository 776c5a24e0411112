"""Admission control of the HTTP frontend: how many requests are in flight, and refusing past the limit.

:class:`Admission` counts the requests the frontend is serving now against
``FrontendConfig.max_concurrent_requests``. :meth:`Admission.admit` takes a
slot or raises the OpenAI-format 429 (``rate_limit_exceeded`` with
``Retry-After``); :meth:`Admission.release` gives it back when the request
ends, however it ends. Both keep the ``shoal_requests_in_flight`` gauge and
the ``shoal_rejected_total{status="429"}`` counter in step. A 503 for "no
instance can take it" is the gateway's (:mod:`frontend.gateway`), not this
module's: admission looks only at this frontend's own load.

Single-threaded by design: it is used from the event loop only, and an
admit-then-await sequence cannot interleave with another admit.
"""

from __future__ import annotations

from frontend.errors import overloaded
from frontend.metrics import FrontendMetrics

__all__ = ["Admission"]


class Admission:
    """Requests in flight against a limit. See the module docstring."""

    def __init__(self, limit: int, *, retry_after_s: int, metrics: FrontendMetrics) -> None:
        if limit < 1:
            raise ValueError("the admission limit must be >= 1")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._metrics = metrics
        self._num_in_flight = 0

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def is_full(self) -> bool:
        return self._num_in_flight >= self.limit

    def admit(self) -> None:
        """Take a slot; raises a 429 :class:`~frontend.errors.APIError` (with Retry-After) when full."""
        if self.is_full:
            self._metrics.rejected.labels(status="429").inc()
            raise overloaded(self.retry_after_s)
        self._num_in_flight += 1
        self._metrics.in_flight.set(self._num_in_flight)

    def release(self) -> None:
        """Give a slot back (once per successful :meth:`admit`)."""
        if self._num_in_flight == 0:
            raise RuntimeError("release() without a matching admit()")
        self._num_in_flight -= 1
        self._metrics.in_flight.set(self._num_in_flight)
