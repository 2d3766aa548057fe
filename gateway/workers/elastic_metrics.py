"""The elastic pools' scaling signal on ``/metrics``, per model (read at scrape time).

``quicserve_pool_desired_replicas`` is what a pool's controller calls for now: the forecast over
the start-up horizon sized against the queue budget (and the queue already waiting). A gateway
whose pool is local acts on it itself; one whose workers run elsewhere (Kubernetes) exports it for
the worker Deployment's autoscaler (``config/k8s/``: KEDA scales to it), with the figures it came
from beside it: the queue's wait against its budget, the forecast, a replica's measured throughput,
the horizon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["DESIRED_REPLICAS", "ElasticCollector", "PoolFigures"]

DESIRED_REPLICAS = "quicserve_pool_desired_replicas"  # the scaling signal (config/k8s/base/worker-autoscaling.yaml)


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """One elastic pool at a scrape (:meth:`~gateway.workers.elastic_pool.ElasticPool.figures`)."""

    model: str
    desired: int
    ready: int
    starting: int
    draining: int
    wait_ratio: float
    queued: int
    demand_rps: float
    replica_rps: float
    horizon_s: float
    waiting: int
    timed_out: int
    started: int
    drained: int


# (name, help, the PoolFigures field); every gauge is labelled by model
_GAUGES = (
    (DESIRED_REPLICAS, "Replicas the elastic pool's controller calls for now (the scaling signal)",
     "desired"),
    ("quicserve_pool_queue_wait_budget_ratio", "The oldest queued request's wait over the queue budget (>= 1: past "
     "it)", "wait_ratio"),
    ("quicserve_pool_queued_requests", "Requests waiting for a slot (the waiting room and the replicas' queues)",
     "queued"),
    ("quicserve_pool_forecast_requests_per_second", "The arrival rate the pool provisions for over the start-up "
     "horizon", "demand_rps"),
    ("quicserve_pool_replica_requests_per_second", "Requests/s one replica completes, as measured (slots over the "
     "mean time a request holds one)", "replica_rps"),
    ("quicserve_pool_startup_horizon_seconds", "The forecast horizon: P90 + 2 sigma of measured start-ups, clamped "
     "to 0.3-2 s", "horizon_s"),
    ("quicserve_waiting_room_requests", "Requests waiting for a pool with no replica to start one", "waiting"),
)


class ElasticCollector:
    def __init__(self, pools: Callable[[], Iterable[PoolFigures]]) -> None:
        self.pools = pools

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        pools = list(self.pools())
        for name, doc, attr in _GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["model"])
            for f in pools:
                fam.add_metric([f.model], getattr(f, attr))
            yield fam
        replicas = GaugeMetricFamily("quicserve_pool_replicas", "The elastic pool's replicas by state",
                                     labels=["model", "state"])
        timed_out = CounterMetricFamily("quicserve_waiting_room_timeouts", "Requests whose wait for a replica "
                                        "reached the waiting room's timeout", labels=["model"])
        scaled = CounterMetricFamily("quicserve_pool_scale_events", "Replicas started (out) and drained (in) by "
                                     "the elastic pool", labels=["model", "direction"])
        for f in pools:
            for state, n in (("ready", f.ready), ("starting", f.starting), ("draining", f.draining)):
                replicas.add_metric([f.model, state], n)
            timed_out.add_metric([f.model], f.timed_out)
            scaled.add_metric([f.model, "out"], f.started)
            scaled.add_metric([f.model, "in"], f.drained)
        yield from (replicas, timed_out, scaled)
