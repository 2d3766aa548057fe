"""Admission's counters on ``/metrics``, read from the stage at scrape time (nothing on the hot path).

* ``quicserve_admission_shed_total{class, reason}``: refusals by load shedding (``queue_bound``,
  ``deadline``, ``key_concurrency``), by priority class.
* ``quicserve_admission_limiters_evicted_busy_total``: limiters dropped from a full table while
  still counting (their clients got a fresh window).
* With ``redis_url``: ``quicserve_admission_redis_round_trips_total``, ``..._errors_total``
  (renewal rounds the store did not answer), ``..._fail_open_admits_total`` (requests admitted
  uncounted while it was unreachable, ``redis_fail = "open"``), ``..._script_reloads_total``
  (scripts loaded again: the store restarted empty) and the gauge ``..._limiters`` (leased
  limiters held).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .gate import Admission

if TYPE_CHECKING:
    from .redis_limits import RedisLeases

__all__ = ["AdmissionCollector"]


class AdmissionCollector:
    """A prometheus_client collector over one :class:`Admission` (and its :class:`RedisLeases`)."""

    def __init__(self, admission: Admission, leases: RedisLeases | None) -> None:
        self.admission, self.leases = admission, leases

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        shed = CounterMetricFamily("quicserve_admission_shed", "Requests refused by load shedding",
                                   labels=["class", "reason"])
        for (cls, reason), n in sorted(self.admission.shedder.shed_by.items()):
            shed.add_metric([str(cls), reason], n)
        yield shed
        yield CounterMetricFamily("quicserve_admission_limiters_evicted_busy",
                                  "Rate limiters dropped from a full table while still counting",
                                  value=self.admission.limits.evicted_busy())
        leases = self.leases
        if leases is None:
            return
        for name, doc, value in (
            ("round_trips", "Renewal rounds sent to Redis (one pipeline each)", leases.round_trips),
            ("errors", "Renewal rounds Redis did not answer", leases.errors),
            ("fail_open_admits", "Requests admitted uncounted while Redis was unreachable", leases.fail_open_admits),
            ("script_reloads", "Limit scripts loaded again after NOSCRIPT (Redis restarted empty)", leases.reloads),
        ):
            yield CounterMetricFamily(f"quicserve_admission_redis_{name}", doc, value=value)
        yield GaugeMetricFamily("quicserve_admission_redis_limiters", "Redis-leased limiters held",
                                value=leases.limiters())
