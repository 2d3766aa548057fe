"""Replica health and the retry budget on ``/metrics`` (read at scrape time, from the pool)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .pool import ModelPool

__all__ = ["HealthCollector"]


class HealthCollector:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        health, budget = self.pool.health, self.pool.budget
        state = GaugeMetricFamily("quicserve_replica_state", "1 for each replica's breaker state (closed: serving; "
                                  "open: ejected; half_open: probing)", labels=["replica", "state"])
        ejected = CounterMetricFamily("quicserve_replica_ejections", "Times a replica was ejected (breaker or "
                                      "latency outlier)", labels=["replica"])
        for b in health.breakers.values():
            state.add_metric([b.name, b.state], 1)
            ejected.add_metric([b.name], b.times_opened)
        yield state
        yield ejected
        yield CounterMetricFamily("quicserve_replica_transitions", "Breaker state changes", value=health.transitions)
        yield CounterMetricFamily("quicserve_routing_panics", "Picks among ejected replicas: every replica of the "
                                  "pool was ejected", value=health.panics)
        yield CounterMetricFamily("quicserve_routed_requests", "Requests routed to a replica", value=budget.requests)
        yield CounterMetricFamily("quicserve_routing_attempts", "Submissions to replicas, retries included",
                                  value=budget.attempts)
        yield CounterMetricFamily("quicserve_stream_failovers", "Streams resumed on another replica after their "
                                  "first token, their replica lost (mid-stream failover)", value=budget.failovers)
        yield GaugeMetricFamily("quicserve_retry_amplification", "Attempts per routed request since start",
                                value=budget.attempts / budget.requests if budget.requests else 1.0)
        yield CounterMetricFamily("quicserve_retry_budget_refused", "Retries the retry budget refused",
                                  value=budget.refused)
