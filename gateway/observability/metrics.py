"""Prometheus metrics for the gateway (prometheus_client exposition, one registry per app).

The per-request series (request counts, TTFT, time per output token -- both
for streamed responses, whose tokens the gateway sees arrive -- e2e latency,
in-flight) are plain Python ints and lists updated without locks --
the gateway is one event-loop thread -- and turned into Prometheus families
by a collector at scrape time. prometheus_client's own Counter/Histogram take
a lock per ``inc``; with ~10 updates per request that was a fifth of the
handler's CPU. Rare events use ordinary prometheus_client Counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from transport.common.stats_series import STATS_SERIES

__all__ = ["GatewayMetrics", "Series", "FastHistogram", "CONTENT_TYPE_LATEST"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class FastHistogram:
    """Bucket counts + sum; ``observe`` is one bisect and two adds (single-threaded use)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((bound, float(acc)))
        return out


class Series:
    """One (route, model)'s request figures: counts by (status, protocol), the latency histograms,
    the completion tokens. The pipeline adds to them once or twice per request (one dictionary
    lookup by string each time); the collector reads them when scraped."""

    __slots__ = ("requests", "e2e", "ttft", "tpot", "output_tokens")

    def __init__(self) -> None:
        self.requests: dict[tuple[int, str], int] = {}
        self.e2e = FastHistogram(LATENCY_BUCKETS)
        self.ttft = FastHistogram(LATENCY_BUCKETS)  # rendered once it holds an observation
        self.tpot = FastHistogram(TPOT_BUCKETS)
        self.output_tokens = 0


class GatewayMetrics:
    """Request counts by route/status/protocol, TTFT, TPOT, e2e latency, in-flight."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.merge: Callable[[bytes], bytes] | None = None  # gateway/multiproc: this process's text + the others'
        r = self.registry
        # every request series is labelled by model: a configured or announced name, "" for routes
        # that name none (bounded: the pool canonicalises names and refuses unknown ones)
        self.series: dict[str, dict[str, Series]] = {}  # route -> model -> its figures (string keys only)
        self.route_leaves: dict[tuple[str, str], int] = {}  # (routing rule leaf, model) -> requests
        self.shadows: dict[tuple[str, str, str], int] = {}  # (leaf, shadow model, ok|failed|skipped) -> copies
        self.in_flight = 0
        self.protocol_errors = Counter("quicserve_protocol_errors",
                                       "Requests rejected by a protocol adapter before routing",
                                       ["status", "protocol"], registry=r)
        self.workers_ready = Gauge("quicserve_workers_ready", "Worker connections ready", registry=r)
        self.worker_restarts = Counter("quicserve_worker_restarts", "Local worker processes restarted",
                                       registry=r)
        self.retries = Counter("quicserve_request_retries",
                               "Requests resubmitted to another worker before their first token", registry=r)
        self.drain_cut = Counter("quicserve_drain_cut_requests",
                                 "Requests ended with a shutting_down error at the drain deadline", registry=r)
        self.rebalanced = Counter("quicserve_rebalanced_requests",
                                  "Requests moved before their first token to a replica that became ready",
                                  registry=r)
        r.register(_RequestCollector(self))

    def of(self, route: str, model: str) -> Series:
        """The figures of requests to ``route`` for ``model`` (created on first use)."""
        by_model = self.series.get(route)
        if by_model is None:
            by_model = self.series[route] = {}
        s = by_model.get(model)
        if s is None:
            s = by_model[model] = Series()
        return s

    def request_done(self, route: str, status: int, protocol: str, seconds: float, model: str = "",
                     ttft: float | None = None, tpot: float | None = None, tokens: int = 0) -> None:
        """One request ended (``seconds`` after it arrived); a finished generation also gives its first
        token's latency, its mean time per output token after the first and its completion tokens.

        A non-streaming response is delivered by the worker in one piece (``Submit.buffered``): its
        ``ttft`` is when the transport saw its first token (the worker stamps nothing; the piece
        arrives once the request ends, so this is the first token's time at the earliest the gateway
        can know it), and its ``tpot`` is None.
        """
        by_model = self.series.get(route)
        s = by_model.get(model) if by_model is not None else None
        if s is None:
            s = self.of(route, model)
        key = (status, protocol)
        req = s.requests
        req[key] = req.get(key, 0) + 1
        h = s.e2e  # FastHistogram.observe, written out (once per request for each)
        h.counts[bisect_left(h.bounds, seconds)] += 1
        h.sum += seconds
        if ttft is not None:
            h = s.ttft
            h.counts[bisect_left(h.bounds, ttft)] += 1
            h.sum += ttft
            if tpot is not None:
                h = s.tpot
                h.counts[bisect_left(h.bounds, tpot)] += 1
                h.sum += tpot
        if tokens:
            s.output_tokens += tokens

    def count(self, route: str, status: int, protocol: str, model: str = "") -> int:
        """Requests to ``route`` for ``model`` that ended with ``status`` over ``protocol`` (tests, diagnostics)."""
        s = self.series.get(route, {}).get(model)
        return 0 if s is None else s.requests.get((status, protocol), 0)

    def routed(self, leaf: str, model: str) -> None:
        """A routing rule's leaf sent a request to ``model`` (bounded: the configured leaves and models)."""
        key = (leaf, model)
        self.route_leaves[key] = self.route_leaves.get(key, 0) + 1

    def shadowed(self, leaf: str, model: str, outcome: str) -> None:
        """A shadow copy ended (``ok``, ``failed``) or was skipped at its bound (``skipped``)."""
        key = (leaf, model, outcome)
        self.shadows[key] = self.shadows.get(key, 0) + 1

    def protocol_error(self, status: int, protocol: str) -> None:
        self.protocol_errors.labels(str(status), protocol).inc()

    def watch_workers(self, connections: Callable[[], Iterable[Any]]) -> None:
        """Export each worker connection's in-flight count and last Stats at scrape time."""
        self.registry.register(_WorkerCollector(connections))

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        return text if self.merge is None else self.merge(text)  # several gateway processes: the whole gateway


class _RequestCollector:
    def __init__(self, m: GatewayMetrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.m
        series = sorted((route, model, s) for route, by_model in m.series.items() for model, s in by_model.items())
        req = CounterMetricFamily("quicserve_requests", "HTTP requests handled",
                                  labels=["route", "status", "protocol", "model"])
        for route, model, s in series:
            for (status, proto), n in sorted(s.requests.items()):
                req.add_metric([route, str(status), proto, model], n)
        yield req
        tok = CounterMetricFamily("quicserve_output_tokens", "Completion tokens sent", labels=["route", "model"])
        for route, model, s in series:
            if s.output_tokens or any(s.ttft.counts):  # a generation finished here
                tok.add_metric([route, model], s.output_tokens)
        yield tok
        leaves = CounterMetricFamily("quicserve_route_decisions", "Requests sent by a routing rule's leaf to a model",
                                     labels=["leaf", "model"])
        for (leaf, model), n in sorted(m.route_leaves.items()):
            leaves.add_metric([leaf, model], n)
        yield leaves
        shadows = CounterMetricFamily("quicserve_shadow_requests", "Shadow copies of requests, by outcome (answers "
                                      "dropped)", labels=["leaf", "model", "outcome"])
        for key, n in sorted(m.shadows.items()):
            shadows.add_metric(list(key), n)
        yield shadows
        yield GaugeMetricFamily("quicserve_requests_in_flight", "Requests being handled", value=m.in_flight)
        for name, doc, attr in (
            ("quicserve_time_to_first_token_seconds", "Request arrival to first token", "ttft"),
            ("quicserve_time_per_output_token_seconds", "Mean time between output tokens after the first, per request",
             "tpot"),
            ("quicserve_request_duration_seconds", "Request arrival to last byte", "e2e"),
        ):
            fam = HistogramMetricFamily(name, doc, labels=["route", "model"])
            for route, model, s in series:
                h: FastHistogram = getattr(s, attr)
                if any(h.counts):  # a series that never observed one is not rendered
                    fam.add_metric([route, model], h.cumulative(), h.sum)
            yield fam


class _WorkerCollector:
    """Per-worker series read from ``WorkerConnection.latest_stats`` when scraped."""

    def __init__(self, connections: Callable[[], Iterable[Any]]) -> None:
        self._connections = connections

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("quicserve_worker_in_flight", "Requests this gateway has open on the worker",
                                      labels=["worker"])
        info = GaugeMetricFamily("quicserve_worker_info", "1 per worker and model it serves (join on worker)",
                                 labels=["worker", "model"])
        fams = [(CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["worker"])
                for name, kind, doc, _ in STATS_SERIES]
        for i, conn in enumerate(self._connections()):
            name = conn.peer_hello.identity or f"worker-{i}"
            in_flight.add_metric([name], conn.in_flight)
            for model in conn.peer_hello.models:
                info.add_metric([name, model], 1)
            st = conn.latest_stats
            if st is None:
                continue
            for fam, (_, _, _, value) in zip(fams, STATS_SERIES, strict=True):
                v = value(st)
                if v is not None:
                    fam.add_metric([name], v)
        yield in_flight
        yield info
        yield from fams
