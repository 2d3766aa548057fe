"""Prometheus metrics for the gateway (prometheus_client, one registry per app).

Label children are cached in plain dicts so the hot path costs a dict lookup
and an ``inc``/``observe`` per request, not a ``labels()`` call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["GatewayMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_TPOT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    """Request counts by route/status/protocol, TTFT, TPOT, e2e latency, in-flight."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("quicserve_requests", "HTTP requests handled",
                                ["route", "status", "protocol"], registry=r)
        self.protocol_errors = Counter("quicserve_protocol_errors",
                                       "Requests rejected by a protocol adapter before routing",
                                       ["status", "protocol"], registry=r)
        self.ttft = Histogram("quicserve_time_to_first_token_seconds", "Request arrival to first token",
                              ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("quicserve_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              ["route"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("quicserve_request_duration_seconds", "Request arrival to last byte",
                             ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.output_tokens = Counter("quicserve_output_tokens", "Completion tokens sent", ["route"],
                                     registry=r)
        self.in_flight = Gauge("quicserve_requests_in_flight", "Requests being handled", registry=r)
        self.workers_ready = Gauge("quicserve_workers_ready", "Worker connections ready", registry=r)
        self.worker_restarts = Counter("quicserve_worker_restarts", "Local worker processes restarted",
                                       registry=r)
        self.retries = Counter("quicserve_request_retries",
                               "Requests resubmitted to another worker before their first token",
                               registry=r)
        self._req: dict[tuple[str, int, str], Callable[[], None]] = {}
        self._ttft: dict[str, Callable[[float], None]] = {}
        self._tpot: dict[str, Callable[[float], None]] = {}
        self._e2e: dict[str, Callable[[float], None]] = {}
        self._tokens: dict[str, Callable[[float], None]] = {}

    def request_done(self, route: str, status: int, protocol: str, seconds: float) -> None:
        key = (route, status, protocol)
        inc = self._req.get(key)
        if inc is None:
            inc = self._req[key] = self.requests.labels(route, str(status), protocol).inc
        inc()
        obs = self._e2e.get(route)
        if obs is None:
            obs = self._e2e[route] = self.e2e.labels(route).observe
        obs(seconds)

    def tokens(self, route: str, ttft: float, tpot: float | None, n: int) -> None:
        """One generation finished: first-token latency, mean inter-token time, count."""
        obs = self._ttft.get(route)
        if obs is None:
            obs = self._ttft[route] = self.ttft.labels(route).observe
        obs(ttft)
        if tpot is not None:
            o2 = self._tpot.get(route)
            if o2 is None:
                o2 = self._tpot[route] = self.tpot.labels(route).observe
            o2(tpot)
        inc = self._tokens.get(route)
        if inc is None:
            inc = self._tokens[route] = self.output_tokens.labels(route).inc
        inc(n)

    def protocol_error(self, status: int, protocol: str) -> None:
        self.protocol_errors.labels(str(status), protocol).inc()

    def watch_workers(self, connections: Callable[[], Iterable[Any]]) -> None:
        """Export each worker connection's in-flight count and last Stats at scrape time."""
        self.registry.register(_WorkerCollector(connections))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector:
    """Per-worker gauges read from ``WorkerConnection.latest_stats`` when scraped."""

    def __init__(self, connections: Callable[[], Iterable[Any]]) -> None:
        self._connections = connections

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fams = {
            "in_flight": GaugeMetricFamily("quicserve_worker_in_flight", "Requests this gateway has open on the worker",
                                           labels=["worker"]),
            "running": GaugeMetricFamily("quicserve_worker_running", "Sequences running (worker Stats)",
                                         labels=["worker"]),
            "queue_depth": GaugeMetricFamily("quicserve_worker_queue_depth", "Requests waiting (worker Stats)",
                                             labels=["worker"]),
            "kv_blocks_free": GaugeMetricFamily("quicserve_worker_kv_blocks_free", "Free KV blocks (worker Stats)",
                                                labels=["worker"]),
        }
        for i, conn in enumerate(self._connections()):
            name = conn.peer_hello.identity or f"worker-{i}"
            fams["in_flight"].add_metric([name], conn.in_flight)
            st = conn.latest_stats
            if st is not None:
                fams["running"].add_metric([name], st.running)
                fams["queue_depth"].add_metric([name], st.queue_depth)
                fams["kv_blocks_free"].add_metric([name], st.kv_blocks_free)
        yield from fams.values()
