"""A discrete-event simulator of one elastic pool over an arrival trace, in simulated time.

How it works: a heap of events (request completions, replicas becoming ready, arrivals, the
controller's ticks) is played in time order. Requests wait in one FIFO queue per pool; a ready
replica serves ``slots`` requests at once and the queue's head goes to the least loaded one (as
the gateway's LeastLoaded policy does). A replica asked for becomes ready after a start-up time
drawn from a lognormal distribution (a measured-looking one: median ~0.7 s, right tail); every
measured start-up is reported to the controller. A draining replica takes no new request and
stops once its last one completes. Replica-seconds count every replica from the moment it was
asked for (a starting replica holds its accelerator) until it stopped, within the trace.

:func:`bursty_trace` builds the issue's trace: a diurnal base (a cosine between ``trough`` and 1 of
``base_rps``) with bursts of ``burst_factor``x for ``burst_s``, Poisson arrivals within
(by thinning), and a service time per request. Everything draws from seeded generators, so the
same seed gives every controller the same trace and the same start-up times.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from gateway.workers.elastic import Controller, Decision, PoolView, ReplicaView

__all__ = ["SimResult", "StaticController", "Startup", "Trace", "bursty_trace", "percentile", "simulate"]

_DONE, _READY, _ARRIVAL, _TICK = range(4)  # order of simultaneous events


@dataclass(frozen=True, slots=True)
class Trace:
    """Arrival times and service times (seconds), and the rates the trace was drawn from."""

    arrivals: tuple[float, ...]
    service: tuple[float, ...]
    duration_s: float
    peak_rps: float  # the highest rate of the generating process
    mean_rps: float  # arrivals per second over the whole trace
    bursts: tuple[float, ...] = ()  # when each burst began


def bursty_trace(*, seed: int, duration_s: float = 3600.0, base_rps: float = 8.0, period_s: float = 3600.0,
                 trough: float = 0.3, burst_every_s: float = 480.0, burst_factor: float = 5.0,
                 burst_s: float = 60.0, service_s: float = 2.0, service_cv: float = 0.5) -> Trace:
    """A diurnal base with bursts of ``burst_factor``x for ``burst_s``; Poisson arrivals within."""
    rng = random.Random(seed)
    bursts: list[float] = []
    t = rng.expovariate(1 / burst_every_s)
    while t < duration_s:
        bursts.append(t)
        t += burst_s + rng.expovariate(1 / burst_every_s)

    def rate(t: float) -> float:
        base = base_rps * (trough + (1 - trough) * (1 - math.cos(2 * math.pi * t / period_s)) / 2)
        in_burst = any(b <= t < b + burst_s for b in bursts)
        return base * (burst_factor if in_burst else 1.0)

    peak = base_rps * burst_factor
    sigma = math.sqrt(math.log(1 + service_cv**2))
    mu = math.log(service_s) - sigma**2 / 2  # lognormal with mean service_s
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak < rate(t):
            arrivals.append(t)
    service = tuple(rng.lognormvariate(mu, sigma) for _ in arrivals)
    return Trace(tuple(arrivals), service, duration_s, peak, len(arrivals) / duration_s, tuple(bursts))


@dataclass(frozen=True, slots=True)
class Startup:
    """A replica's start-to-ready time: lognormal around ``median_s``."""

    median_s: float = 0.7
    sigma: float = 0.3

    def draw(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median_s), self.sigma)


class StaticController:
    """A fixed pool: never starts or stops a replica."""

    def observe_arrival(self, now: float, n: int = 1) -> None:
        pass

    def observe_startup(self, seconds: float) -> None:
        pass

    def decide(self, now: float, view: PoolView) -> Decision:
        return Decision()


@dataclass(slots=True)
class SimResult:
    """Queue waits per request (arrival order) and what the pool cost."""

    waits: list[float]
    replica_seconds: float
    starts: int
    peak_replicas: int
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, replicas alive) at each change

    def p(self, q: float) -> float:
        return percentile(self.waits, q)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 1]."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(slots=True)
class _Replica:
    born: float
    ready: bool = False
    busy: int = 0
    draining: bool = False
    stopped: float | None = None


def simulate(trace: Trace, controller: Controller, *, slots: int, initial: int = 0,
             startup: Startup | None = None, seed: int = 0, tick_s: float = 0.1) -> SimResult:
    """Play ``trace`` through one pool that ``controller`` scales; ``initial`` replicas start ready."""
    startup = startup or Startup()
    rng = random.Random(seed)
    mean_service = sum(trace.service) / max(1, len(trace.service))
    capacity = slots / mean_service if mean_service else float(slots)
    replicas: dict[int, _Replica] = {i: _Replica(0.0, ready=True) for i in range(initial)}  # alive ones
    gone: list[_Replica] = []
    next_id = initial
    queue: deque[tuple[int, float]] = deque()  # (request index, arrival time)
    waits = [0.0] * len(trace.arrivals)
    events: list[tuple[float, int, int]] = []  # (time, kind, payload)
    starts = 0
    alive = initial
    peak_alive = initial
    timeline: list[tuple[float, int]] = [(0.0, initial)]
    if trace.arrivals:
        heapq.heappush(events, (trace.arrivals[0], _ARRIVAL, 0))
    heapq.heappush(events, (0.0, _TICK, 0))

    def stop(rid: int, now: float) -> None:
        nonlocal alive
        r = replicas.pop(rid)
        r.stopped = now
        gone.append(r)
        alive -= 1
        timeline.append((now, alive))

    def dispatch(now: float) -> None:
        while queue:
            free = [(r.busy, rid) for rid, r in replicas.items() if r.ready and not r.draining and r.busy < slots]
            if not free:
                return
            _, rid = min(free)
            idx, arrived = queue.popleft()
            waits[idx] = now - arrived
            replicas[rid].busy += 1
            heapq.heappush(events, (now + trace.service[idx], _DONE, rid))

    def view(now: float) -> PoolView:
        ready = tuple(ReplicaView(rid, r.busy, r.draining) for rid, r in replicas.items() if r.ready)
        starting = sum(1 for r in replicas.values() if not r.ready)
        oldest = now - queue[0][1] if queue else 0.0
        return PoolView(ready, starting, slots, capacity, len(queue), oldest)

    def apply(now: float, decision: Decision) -> None:
        nonlocal next_id, starts, alive, peak_alive
        for _ in range(decision.start):
            replicas[next_id] = _Replica(now)
            heapq.heappush(events, (now + startup.draw(rng), _READY, next_id))
            next_id += 1
            starts += 1
            alive += 1
            peak_alive = max(peak_alive, alive)
            timeline.append((now, alive))
        for rid in decision.drain:
            r = replicas[rid]
            r.draining = True
            if r.busy == 0:
                stop(rid, now)

    while events:
        now, kind, payload = heapq.heappop(events)
        if kind == _DONE:
            r = replicas[payload]
            r.busy -= 1
            if r.draining and r.busy == 0:
                stop(payload, now)
            dispatch(now)
        elif kind == _READY:
            r = replicas[payload]
            r.ready = True
            controller.observe_startup(now - r.born)
            dispatch(now)
        elif kind == _ARRIVAL:
            queue.append((payload, now))
            controller.observe_arrival(now)
            if payload + 1 < len(trace.arrivals):
                heapq.heappush(events, (trace.arrivals[payload + 1], _ARRIVAL, payload + 1))
            dispatch(now)
            if queue and not replicas:
                apply(now, controller.decide(now, view(now)))  # from zero: no need to wait for a tick
        else:
            apply(now, controller.decide(now, view(now)))
            dispatch(now)
            more = now < trace.duration_s or queue or any(r.busy for r in replicas.values())
            if more:
                heapq.heappush(events, (now + tick_s, _TICK, 0))

    end = trace.duration_s
    cost = sum(max(0.0, min(end, r.stopped if r.stopped is not None else end) - r.born)
               for r in [*replicas.values(), *gone])
    return SimResult(waits, cost, starts, peak_alive, timeline)
