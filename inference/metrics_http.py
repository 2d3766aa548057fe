"""The worker's own Prometheus ``/metrics`` (``--metrics-listen HOST:PORT``), for remote workers.

A gateway exports the Stats of every worker it is connected to; a worker on another
host (a Kubernetes worker pod, say) is also scraped directly, so its engine figures
are there even when no gateway is. The series are the gateway's (one table,
:data:`transport.common.stats_series.STATS_SERIES`) without the ``worker`` label, since the
scrape target is the worker; they are read from the Stats the worker last sent, so a
scrape costs the engine nothing. prometheus_client serves them from its own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from transport.common.stats_series import STATS_SERIES
from transport.common.worker_options import parse_host_port
from transport.messages import Stats

__all__ = ["serve_metrics"]


class _StatsCollector:
    def __init__(self, stats: Callable[[], Stats | None], models: tuple[str, ...]) -> None:
        self._stats = stats
        self._models = models

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("quicserve_worker_info", "1 per model this worker serves", labels=["model"])
        for m in self._models:
            info.add_metric([m], 1)
        yield info
        st = self._stats()
        for name, kind, doc, value in STATS_SERIES:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc)
            v = value(st) if st is not None else None
            if v is not None:
                fam.add_metric([], v)
            yield fam


def serve_metrics(listen: str, stats: Callable[[], Stats | None], models: tuple[str, ...]) -> str:
    """Start serving; returns the URL of ``/metrics`` (with the port actually bound)."""
    host, port = parse_host_port(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, models))
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    return f"http://{f'[{host}]' if ':' in host else host}:{bound}/metrics"
