"""Counts the gateway's parts keep as plain attributes, on ``/metrics``, read at scrape time.

Why a collector: the QUIC listener's session tickets and 0-RTT requests, the cycle sweeper's
collections and the supervisor's worker set are ints and lists their owners update anyway
(tests read them); reading them when Prometheus scrapes puts nothing on the request path.
Admission's and Redis's counters have their own collector (:mod:`gateway.admission.metrics`).

* ``quicserve_h3_early_data_requests_total{outcome}``: requests that arrived in 0-RTT data,
  ``served`` or answered ``too_early`` (425: route not listed as safe, budget spent, or replay
  protection off).
* ``quicserve_quic_session_tickets_issued_total``; ``..._presented_total{outcome}``: tickets
  ``resumed`` or ``refused`` (unknown, expired, sealed under a dropped key, or already used:
  a replay).
* ``quicserve_quic_replay_store_full_total``: single-use claims refused because the store held
  ``max_tickets`` unexpired keys (those clients did a full handshake); ``..._keys``: held now.
* ``quicserve_quic_connections``: QUIC connections open.
* ``quicserve_gc_sweeps_total``, ``quicserve_gc_sweep_collected_objects_total``: the cycle
  sweeper's full collections and what they freed.
* ``quicserve_workers_configured{model}``: workers the gateway supervises (configured local and
  remote, and discovered), ``..._connected{model}``: of them, attached to the pool now,
  ``..._failed{model}``: stopped for good (bad options). Configured against connected: the
  replicas down (``model``: the name the settings serve, as the request series name it).
* ``[routing] policy = "cache_aware"``'s counters: :mod:`gateway.routing.cache_metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..routing.cache_metrics import cache_routing_metrics
from ..workers.config import served_name_of

if TYPE_CHECKING:
    from ..gc_sweep import CycleSweeper
    from ..http.quic_listener import QuicListener
    from ..workers.supervisor import WorkerSupervisor

__all__ = ["GatewayCounters"]


class GatewayCounters:
    """A prometheus_client collector over the QUIC listener, the cycle sweeper and the supervisor
    (each None where the gateway runs without it)."""

    def __init__(self, quic: QuicListener | None, sweeper: CycleSweeper | None,
                 supervisor: WorkerSupervisor | None) -> None:
        self.quic, self.sweeper, self.supervisor = quic, sweeper, supervisor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.quic is not None:
            yield from _quic(self.quic)
        if self.sweeper is not None:
            s = self.sweeper
            yield CounterMetricFamily("quicserve_gc_sweeps", "Full cyclic collections run by the cycle sweeper",
                                      value=s.sweeps)
            yield CounterMetricFamily("quicserve_gc_sweep_collected_objects", "Objects the cycle sweeper's "
                                      "collections freed", value=s.collected)
        if self.supervisor is not None:
            yield from _workers(self.supervisor)
            yield from cache_routing_metrics(self.supervisor.pool)


def _quic(q: QuicListener) -> Iterator[Metric]:
    state, tickets = q.state, q.tickets
    early = CounterMetricFamily("quicserve_h3_early_data_requests", "HTTP/3 requests that arrived in 0-RTT data, "
                                "served or answered 425 Too Early", labels=["outcome"])
    early.add_metric(["served"], state.early_served)
    early.add_metric(["too_early"], state.early_refused)
    yield early
    yield CounterMetricFamily("quicserve_quic_session_tickets_issued", "QUIC session tickets issued",
                              value=tickets.issued)
    presented = CounterMetricFamily("quicserve_quic_session_tickets_presented", "Session tickets presented for "
                                    "resumption: resumed, or refused (unknown, expired, or already used: a replay)",
                                    labels=["outcome"])
    presented.add_metric(["resumed"], tickets.resumed)
    presented.add_metric(["refused"], tickets.refused)
    yield presented
    yield CounterMetricFamily("quicserve_quic_replay_store_full", "Single-use ticket claims refused because the "
                              "replay store was full (a full handshake instead)", value=tickets.used.refused)
    yield GaugeMetricFamily("quicserve_quic_replay_store_keys", "Used tickets remembered until they expire",
                            value=len(tickets.used))
    yield GaugeMetricFamily("quicserve_quic_connections", "QUIC connections open", value=q.connections)


def _workers(sup: WorkerSupervisor) -> Iterator[Metric]:
    by_model: dict[str, list[int]] = {}  # model -> [configured, connected, failed]
    for w in sup.workers:
        row = by_model.setdefault(served_name_of(w.ws), [0, 0, 0])
        row[0] += 1
        row[1] += w.conn is not None and not w.conn.closed
        row[2] += w.failure is not None
    for i, (name, doc) in enumerate((
        ("configured", "Workers the gateway supervises (configured local and remote, and discovered)"),
        ("connected", "Supervised workers attached to the pool now"),
        ("failed", "Supervised workers stopped for good (a restart would fail the same way)"),
    )):
        fam = GaugeMetricFamily(f"quicserve_workers_{name}", doc, labels=["model"])
        for model, row in sorted(by_model.items()):
            fam.add_metric([model], row[i])
        yield fam
