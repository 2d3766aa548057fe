"""How long workers take to start, per model: what the supervisor measured and what they reported.

A local worker's start-to-ready time is measured by the supervisor, from the process's spawn to its
connection in the pool (the time an elastic pool waits for a replica it asked for). A worker also
reports its own phases, in its ``ready`` event and its Hello (``Hello.startup``: load, compile,
warm-up); a remote worker's start is known by those alone. Both are kept per model: the recent
totals for an elastic pool's horizon (:class:`~gateway.workers.elastic.StartupTimes` is fed from
here), and histograms on ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily, Metric

from ..observability.metrics import FastHistogram

__all__ = ["PHASES", "StartupLog", "ModelStartups"]

PHASES = ("load", "compile", "warmup")
# seconds: a synthetic worker starts in ~1 s, the tiny model in tens, a large checkpoint in minutes
BOUNDS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


@dataclass(slots=True)
class ModelStartups:
    """One model's start-ups."""

    ready: FastHistogram = field(default_factory=lambda: FastHistogram(BOUNDS))  # measured start-to-ready
    phases: dict[str, FastHistogram] = field(default_factory=lambda: {p: FastHistogram(BOUNDS) for p in PHASES})
    last: tuple[float, ...] = ()  # the last reported phases


class StartupLog:
    """Start-ups by model; ``listeners`` hear each measured start-to-ready time (elastic pools)."""

    def __init__(self) -> None:
        self.models: dict[str, ModelStartups] = {}
        self.listeners: list[Callable[[str, float], None]] = []

    def _of(self, model: str) -> ModelStartups:
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = ModelStartups()
        return m

    def ready(self, model: str, seconds: float, phases: Sequence[float] = ()) -> None:
        """A worker of ``model`` became ready ``seconds`` after it was started; ``phases``: what it said."""
        m = self._of(model)
        m.ready.observe(seconds)
        self.reported(model, phases)
        for hear in self.listeners:
            hear(model, seconds)

    def reported(self, model: str, phases: Sequence[float]) -> None:
        """A worker's own account of its start-up (local: its ready event; remote: its Hello)."""
        if len(phases) != len(PHASES):
            return
        m = self._of(model)
        for name, s in zip(PHASES, phases, strict=True):
            m.phases[name].observe(s)
        m.last = tuple(phases)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ready = HistogramMetricFamily("quicserve_worker_startup_seconds", "Local workers' start-to-ready time "
                                      "(spawn to connected), as the gateway measured it", labels=["model"])
        phase = HistogramMetricFamily("quicserve_worker_startup_phase_seconds", "Workers' start-up phases as "
                                      "they report them (load, compile, warmup)", labels=["model", "phase"])
        for model, m in sorted(self.models.items()):
            if m.ready.sum or any(m.ready.counts):
                ready.add_metric([model], m.ready.cumulative(), m.ready.sum)
            for name, h in m.phases.items():
                if any(h.counts):
                    phase.add_metric([model, name], h.cumulative(), h.sum)
        yield ready
        yield phase
