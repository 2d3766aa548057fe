"""Elastic worker pools: when to start a replica and when to drain one (sans-I/O, clock passed in).

How it works: the pool's adapter (or :mod:`gateway.workers.elastic_sim`) tells a controller what
it sees -- each arrival (:meth:`observe_arrival`), each measured start-to-ready time
(:meth:`observe_startup`) -- and asks it, on a timer, what to do given the pool as it is now
(:class:`PoolView`). The answer is a :class:`Decision`: how many replicas to start, which ones to
drain (a draining replica takes no new request, finishes what it has, then stops).

:class:`ElasticController` scales on a forecast. Its horizon is how long a replica takes to become
ready, the write-up's pre-warm threshold: P90 + 2 sigma of the measured start-up times, clamped
to 300-2000 ms (:class:`StartupTimes`). Arrivals are counted in short bins and smoothed twice with
Holt's linear method (:class:`HoltRate`): a fast estimate (level + trend, ~2.5 s of memory) that
sees a burst within a second or two, and a slow level (~10 s) that Poisson noise hardly moves. The
demand it provisions for is the slow level, or -- once the fast forecast's peak within the horizon
passes it by more than ``burst_sigmas`` of the fast estimate's own Poisson noise, a burst -- that
peak (plus an optional Poisson margin), plus a busy slot for each request already queued. It sizes
the pool for that demand with :mod:`gateway.workers.elastic_model`: the fewest replicas for which
Erlang C puts at most ``late_target`` of requests past the queue budget, the wait's scale corrected
by the ratio of the queue the pool shows to the queue M/M/c predicts for it (as NVIDIA Dynamo's
planner corrects its latency model; service times less variable than exponential make it < 1).
``late_target`` is the model's share at the forecast's peak; what a pool then sees is far lower
(0.2-0.4% past the budget at the default 5% in tests/bench/bench_elastic.py's runs). With
``late_target=None`` it applies the write-up's rule as such: demand over capacity at
``target_utilisation``. A replica starts as soon as ready + starting replicas fall short: one
started now is ready when the forecast comes due.

Scale-in is predictive: what a pool must keep is the size for the slow level's upper bound (level +
``keep_sigmas`` of its noise, plus the backlog), a demand the forecast says lasts; the pool drains
down to the most it had to keep over the last dwell -- the slow level's memory, at most ``idle_s``
-- once no replica has been started, become ready or drained for that long (so a lull inside a
burst does not cost a cold start, nor a replica just ready go before it could serve). After a burst
the slow level keeps its replicas until it has come down, then the surplus goes at once. The pool
goes to zero (``min_replicas = 0``) only after ``idle_s`` without an arrival; the next request then
waits while one starts.

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

from .elastic_model import WaitCorrection, mean_queue, replicas_for

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

    def noise(self, rate: float) -> float:
        """The level's standard deviation (requests/s) where arrivals are Poisson at ``rate``."""
        return math.sqrt(max(rate, 0.0) / self.bin_s * self._alpha / (2 - self._alpha))

    @property
    def memory_s(self) -> float:
        """The level's time constant: how far back it mostly looks."""
        return self.bin_s / self._alpha


class ElasticController:
    """Scale on predicted demand over the cold-start horizon (see the module's docstring)."""

    def __init__(self, limits: PoolLimits, startup: StartupTimes | None = None,
                 rate: HoltRate | None = None, margin_sigmas: float = 0.0,
                 late_target: float | None = 0.05, burst_sigmas: float = 3.0, keep_sigmas: float = 2.0,
                 slow: HoltRate | None = None, correction: WaitCorrection | None = None) -> None:
        self.limits = limits
        self.startup = startup or StartupTimes()
        self.rate = rate or HoltRate()  # fast: sees a burst within a second or two
        self.slow = slow or HoltRate(alpha=0.05, beta=0.0)  # slow: the base rate, ~10 s of memory
        self.correction = correction or WaitCorrection()
        self._margin = margin_sigmas  # Poisson margin on the arrivals expected within the horizon
        self._burst = burst_sigmas  # how far the fast rate must pass the slow one to count as a burst
        self._keep = keep_sigmas  # the slow rate's upper bound a scale-in must still cover
        self._late = late_target  # None: size by target_utilisation; else by Erlang C against the budget
        self._last_arrival: float | None = None
        self._last_tick: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (t, keep): decreasing, within the dwell
        self._window_start: float | None = None  # since when no replica was started or drained
        self.last_need = 0  # replicas the last decision called for (the scaling signal, exported)
        self.last_demand = 0.0  # requests/s it provisioned for

    def observe_arrival(self, now: float, n: int = 1) -> None:
        self.rate.add(now, n)
        self.slow.add(now, n)
        self._last_arrival = now

    def observe_startup(self, seconds: float) -> None:
        self.startup.add(seconds)

    def demand_rps(self, now: float, view: PoolView) -> float:
        """Requests/s to provision for: the slow rate, plus what the fast forecast's peak within the
        horizon passes it by beyond ``burst_sigmas`` of its noise, plus margin, plus the queue's
        backlog (each queued request as one more busy slot)."""
        self.rate.advance(now)
        self.slow.advance(now)
        h = self.startup.horizon()
        base = self.slow.level
        fast = max(self.rate.level, self.rate.forecast(h))
        peak = fast if fast - base > self._burst * self.rate.noise(max(base, 1.0)) else base
        expected = peak * h
        with_margin = (expected + self._margin * math.sqrt(expected)) / h
        return with_margin + self._backlog(view)

    @staticmethod
    def _backlog(view: PoolView) -> float:
        return view.queued * view.capacity_rps / view.slots

    def _idle(self, now: float, view: PoolView) -> bool:
        last = self._last_arrival
        return (last is None or now - last >= self.limits.idle_s) and view.queued == 0

    def size(self, demand: float, view: PoolView) -> int:
        """Replicas for ``demand`` requests/s (at least one), within the pool's limits."""
        lim = self.limits
        if self._late is None:
            want = math.ceil(demand / (view.capacity_rps * lim.target_utilisation) - 1e-9)
        else:
            want = replicas_for(demand, view.capacity_rps, view.slots, lim.queue_budget_s, self._late,
                                lim.max_replicas, self.correction.factor)
        return min(lim.max_replicas, max(lim.min_replicas, want, 1))

    def needed(self, now: float, view: PoolView) -> int:
        """Replicas the demand calls for, within the pool's limits."""
        if self._idle(now, view):
            self.last_demand = 0.0
            return self.limits.min_replicas
        self.last_demand = demand = self.demand_rps(now, view)
        return self.size(demand, view)

    def _learn(self, now: float, view: PoolView) -> None:
        """Compare the queue with the model's over the last tick (see :class:`WaitCorrection`)."""
        dt = now - self._last_tick if self._last_tick is not None else 0.0
        self._last_tick = now
        servers = len(view.serving) * view.slots
        load = self.slow.level * view.slots / view.capacity_rps
        if not view.starting and servers > load > 0:
            self.correction.observe(dt, view.queued, mean_queue(servers, load))

    def decide(self, now: float, view: PoolView) -> Decision:
        self.last_need = need = self.needed(now, view)
        self._learn(now, view)
        lim = self.limits
        serving = view.serving
        have = len(serving) + view.starting
        # what a scale-in must keep: the need at the slow rate's upper bound (it moves little on noise)
        base = self.slow.level
        upper = base + self._keep * self.slow.noise(max(base, 1.0)) + self._backlog(view)
        keep = lim.min_replicas if self._idle(now, view) else self.size(upper, view)
        dwell = min(lim.idle_s, self.slow.memory_s)
        while self._recent and self._recent[-1][1] <= keep:  # a sliding-window maximum
            self._recent.pop()
        self._recent.append((now, keep))
        while self._recent[0][0] < now - dwell:
            self._recent.popleft()
        if need > have:
            self._window_start = now
            return Decision(start=need - have)
        if view.starting or self._window_start is None:
            self._window_start = now  # the scale-in window opens once every start is done: a replica
            return Decision()  # just ready (the pool's first, say) gets the dwell before it may drain
        if now - self._window_start < dwell:
            return Decision()
        surplus = len(serving) - max(need, self._recent[0][1])
        if surplus <= 0:
            return Decision()
        self._window_start = now  # the next drain needs another dwell of surplus
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
