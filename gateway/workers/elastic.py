"""Elastic worker pools: when to start a replica and when to drain one (sans-I/O, clock passed in).

How it works: the pool's adapter (or :mod:`gateway.workers.elastic_sim`) tells a controller what
it sees -- each arrival (:meth:`observe_arrival`), each measured start-to-ready time
(:meth:`observe_startup`) -- and asks it, on a timer, what to do given the pool as it is now
(:class:`PoolView`). The answer is a :class:`Decision`: how many replicas to start, which ones to
drain (a draining replica takes no new request, finishes what it has, then stops).

:class:`ElasticController` scales on a forecast. Its horizon is how long a replica takes to become
ready, the write-up's pre-warm threshold: P90 + 2 sigma of the measured start-up times, clamped
to 300-2000 ms (:class:`StartupTimes`). Arrivals are counted in short bins and smoothed with
Holt's linear method (level + trend, :class:`HoltRate`); the demand it provisions for is the
higher of the level and the level projected to the end of the horizon (plus an optional Poisson
margin on the arrivals expected within it), plus a busy slot for each request already queued. It
sizes the pool for that demand by Erlang C (:func:`replicas_for`: the fewest replicas for which at
most ``late_target`` of requests would wait past the queue budget), or, with ``late_target=None``,
the write-up's rule as such: demand over capacity at ``target_utilisation``. A replica starts as
soon as ready + starting replicas fall short: one started now is ready when the forecast comes
due. Scale-in: the pool drains down to the most it needed over the last ``idle_s``, and only once
no replica has been started or become ready for ``idle_s`` (so a lull inside a burst does not cost a
cold start, nor a replica just ready go before it could serve);
it goes to zero (``min_replicas = 0``) only after ``idle_s`` without an arrival; the next request
then waits while one starts.

:class:`ReactiveController` is the comparison: it starts replicas only once the oldest queued
request has waited past the budget (enough to serve the queue), and drains one after ``idle_s``
with a whole replica's slots free.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Controller", "Decision", "ElasticController", "HoltRate", "PoolLimits", "PoolView",
           "ReactiveController", "ReplicaView", "StartupTimes", "HORIZON_MIN_S", "HORIZON_MAX_S",
           "replicas_for"]

HORIZON_MIN_S = 0.3  # the write-up's clamp on the pre-warm threshold
HORIZON_MAX_S = 2.0
STARTUP_WINDOW = 64  # start-up times kept (the most recent ones: a compilation cache changes them)


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """One pool's elastic settings."""

    min_replicas: int = 1
    max_replicas: int = 8
    queue_budget_s: float = 0.5  # the longest a request should wait in the pool's queue
    idle_s: float = 30.0  # how long capacity must stay unneeded before a replica drains
    target_utilisation: float = 0.75  # the share of a replica's capacity the forecast may use
    # (the write-up's sizing rule; ElasticController's default sizes by Erlang C instead)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.queue_budget_s <= 0 or self.idle_s <= 0 or not 0 < self.target_utilisation <= 1:
            raise ValueError("queue_budget_s and idle_s must be > 0, target_utilisation in (0, 1]")


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A ready replica as the pool sees it."""

    id: int
    busy: int  # requests it is serving now
    draining: bool = False


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool at one instant: what a controller decides on."""

    replicas: tuple[ReplicaView, ...]  # ready ones (draining ones included, flagged)
    starting: int  # replicas asked for, not yet ready
    slots: int  # requests a replica serves at once (as the workers report)
    capacity_rps: float  # requests/s one replica completes (reported or measured)
    queued: int  # requests waiting in the pool's queue
    oldest_wait_s: float  # how long the head of the queue has waited (0 when empty)

    @property
    def serving(self) -> tuple[ReplicaView, ...]:
        """Ready replicas that take new requests."""
        return tuple(r for r in self.replicas if not r.draining)


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now: start ``start`` replicas, drain the replicas named in ``drain``."""

    start: int = 0
    drain: tuple[int, ...] = ()


class Controller(Protocol):
    """What a pool asks of its scaling policy."""

    def observe_arrival(self, now: float, n: int = 1) -> None: ...

    def observe_startup(self, seconds: float) -> None: ...

    def decide(self, now: float, view: PoolView) -> Decision: ...


class StartupTimes:
    """Measured start-to-ready times; the forecast horizon is P90 + 2 sigma, clamped to 300-2000 ms."""

    def __init__(self, prior_s: float = HORIZON_MAX_S, window: int = STARTUP_WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._prior = prior_s  # the horizon until two start-ups have been measured

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def __len__(self) -> int:
        return len(self._samples)

    def horizon(self) -> float:
        """The pre-warm threshold in seconds."""
        if len(self._samples) < 2:
            raw = self._prior
        else:
            p90 = statistics.quantiles(self._samples, n=10, method="inclusive")[8]
            raw = p90 + 2 * statistics.stdev(self._samples)
        return min(HORIZON_MAX_S, max(HORIZON_MIN_S, raw))


class HoltRate:
    """Arrival rate by Holt's linear method over fixed bins: level (requests/s) and trend (per s)."""

    def __init__(self, bin_s: float = 0.5, alpha: float = 0.2, beta: float = 0.05) -> None:
        self.bin_s, self._alpha, self._beta = bin_s, alpha, beta
        self.level = 0.0
        self._trend = 0.0  # per bin
        self._bin_start: float | None = None
        self._count = 0

    def add(self, now: float, n: int = 1) -> None:
        self.advance(now)
        self._count += n

    def advance(self, now: float) -> None:
        """Close every bin that ended by ``now`` (empty ones count as zero arrivals)."""
        if self._bin_start is None:
            self._bin_start = now
            return
        a, b = self._alpha, self._beta
        while now >= self._bin_start + self.bin_s:
            x = self._count / self.bin_s
            prev = self.level
            self.level = a * x + (1 - a) * (self.level + self._trend)
            self._trend = b * (self.level - prev) + (1 - b) * self._trend
            self.level = max(self.level, 0.0)
            self._count = 0
            self._bin_start += self.bin_s
            if self.level == 0.0 and self._trend <= 0.0:  # idle: skip the rest of the gap at once
                self._trend = 0.0
                gap = math.floor((now - self._bin_start) / self.bin_s)
                self._bin_start += gap * self.bin_s

    @property
    def trend(self) -> float:
        """Change of the rate per second."""
        return self._trend / self.bin_s

    def forecast(self, ahead_s: float) -> float:
        """The rate expected ``ahead_s`` from now (never below zero)."""
        return max(0.0, self.level + self.trend * ahead_s)


def replicas_for(rate: float, capacity_rps: float, slots: int, budget_s: float, late: float,
                 most: int) -> int:
    """The fewest replicas (at most ``most``) for which Erlang C (M/M/c, c = replicas x slots) puts
    the share of requests waiting past ``budget_s`` at or under ``late``."""
    if rate <= 0:
        return 0
    service = slots / capacity_rps  # mean seconds per request (Little's law on one replica)
    a = rate * service  # offered load in busy slots
    b = 1.0  # Erlang B, grown one slot at a time
    for c in range(1, most * slots + 1):
        b = a * b / (c + a * b)
        if c % slots or c <= a:
            continue
        wait = c * b / (c - a * (1 - b))  # Erlang C: P(a request waits at all)
        if wait * math.exp(-(c - a) / service * budget_s) <= late:
            return c // slots
    return most


class ElasticController:
    """Scale on predicted demand over the cold-start horizon (see the module's docstring)."""

    def __init__(self, limits: PoolLimits, startup: StartupTimes | None = None,
                 rate: HoltRate | None = None, margin_sigmas: float = 0.0,
                 late_target: float | None = 0.01) -> None:
        self.limits = limits
        self.startup = startup or StartupTimes()
        self.rate = rate or HoltRate()
        self._margin = margin_sigmas  # Poisson margin on the arrivals expected within the horizon
        self._late = late_target  # None: size by target_utilisation; else by Erlang C against the budget
        self._last_arrival: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (t, need): decreasing need, within idle_s
        self._window_start: float | None = None  # since when no replica was started
        self.last_need = 0  # replicas the last decision called for (the scaling signal, exported)
        self.last_demand = 0.0  # requests/s it provisioned for

    def observe_arrival(self, now: float, n: int = 1) -> None:
        self.rate.add(now, n)
        self._last_arrival = now

    def observe_startup(self, seconds: float) -> None:
        self.startup.add(seconds)

    def demand_rps(self, now: float, view: PoolView) -> float:
        """Requests/s to provision for: forecast peak in the horizon + margin + the queue's backlog
        (each queued request as one more busy slot)."""
        self.rate.advance(now)
        h = self.startup.horizon()
        peak = max(self.rate.level, self.rate.forecast(h))
        expected = peak * h
        with_margin = (expected + self._margin * math.sqrt(expected)) / h
        return with_margin + view.queued * view.capacity_rps / view.slots  # a slot for each one queued

    def needed(self, now: float, view: PoolView) -> int:
        """Replicas the demand calls for, within the pool's limits."""
        lim = self.limits
        idle = self._last_arrival is None or now - self._last_arrival >= lim.idle_s
        if idle and view.queued == 0:
            want, self.last_demand = 0, 0.0
        elif self._late is not None:
            self.last_demand = demand = self.demand_rps(now, view)
            want = max(1, replicas_for(demand, view.capacity_rps, view.slots, lim.queue_budget_s, self._late,
                                       lim.max_replicas))
        else:
            per_replica = view.capacity_rps * lim.target_utilisation
            self.last_demand = demand = self.demand_rps(now, view)
            want = max(1, math.ceil(demand / per_replica - 1e-9))
        return min(lim.max_replicas, max(lim.min_replicas, want))

    def decide(self, now: float, view: PoolView) -> Decision:
        self.last_need = need = self.needed(now, view)
        serving = view.serving
        have = len(serving) + view.starting
        while self._recent and self._recent[-1][1] <= need:  # a sliding-window maximum of the need
            self._recent.pop()
        self._recent.append((now, need))
        while self._recent[0][0] < now - self.limits.idle_s:
            self._recent.popleft()
        if need > have:
            self._window_start = now
            return Decision(start=need - have)
        if view.starting or self._window_start is None:
            self._window_start = now  # the scale-in window opens once every start is done: a replica
            return Decision()  # just ready (the pool's first, say) gets idle_s before it may drain
        if now - self._window_start < self.limits.idle_s:
            return Decision()
        surplus = len(serving) - self._recent[0][1]  # the most the pool needed in the last idle_s
        if surplus <= 0:
            return Decision()
        self._window_start = now  # the next drain needs another idle_s of surplus
        victims = sorted(serving, key=lambda r: (r.busy, -r.id))[:surplus]  # least loaded, youngest
        return Decision(drain=tuple(r.id for r in victims))


class ReactiveController:
    """Start replicas once the queue passes its budget; drain one after sustained spare capacity."""

    def __init__(self, limits: PoolLimits) -> None:
        self.limits = limits
        self._spare_since: float | None = None

    def observe_arrival(self, now: float, n: int = 1) -> None:
        pass

    def observe_startup(self, seconds: float) -> None:
        pass

    def decide(self, now: float, view: PoolView) -> Decision:
        lim = self.limits
        serving = view.serving
        have = len(serving) + view.starting
        if view.queued and (view.oldest_wait_s > lim.queue_budget_s or have == 0):
            self._spare_since = None
            want = min(lim.max_replicas, len(serving) + math.ceil(view.queued / view.slots))
            return Decision(start=max(0, want - have))
        if len(serving) < lim.min_replicas:  # keep the floor (a replica died, or the pool just began)
            return Decision(start=max(0, lim.min_replicas - have))
        free = sum(view.slots - r.busy for r in serving)
        spare = not view.queued and not view.starting and free >= view.slots
        if not spare or len(serving) <= lim.min_replicas:
            self._spare_since = None
            return Decision()
        if self._spare_since is None:
            self._spare_since = now
        if now - self._spare_since < lim.idle_s:
            return Decision()
        self._spare_since = now
        victim = min(serving, key=lambda r: (r.busy, -r.id))
        return Decision(drain=(victim.id,))
