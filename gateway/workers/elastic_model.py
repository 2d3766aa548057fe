"""The elastic controller's queueing model: Erlang C sizing, corrected by the waits the pool shows.

How it works: a pool of ``c`` busy slots (replicas x slots) offered ``a`` slots of load (arrival rate
x mean service time) is modelled as M/M/c. :func:`erlang_c` is the chance that a request waits at
all; the wait of one that does is taken as exponential with mean ``scale x service / (c - a)``, so
the share waiting past a budget ``t`` is ``C(c, a) exp(-(c - a) t / (scale x service))``
(:func:`replicas_for` finds the fewest replicas that keep it under a target). ``scale`` is 1 for
exponential service times; for others the M/G/c approximation (Allen-Cunneen) multiplies the wait
by ``(1 + cv^2) / 2`` of the service time, which a gateway does not see request by request.
:class:`WaitCorrection` learns the factor instead, as NVIDIA Dynamo's planner corrects its latency
model: the ratio of the queue the pool observed to the queue the model predicted for it over the
same time (Little's law makes it the ratio of mean waits), over ticks where the model applies
(every replica asked for is ready and the load is under the pool's slots), with a prior of one
and a memory of ``memory_s``, clamped to ``[lo, hi]``.
"""

from __future__ import annotations

import math

__all__ = ["WaitCorrection", "erlang_c", "mean_queue", "replicas_for"]


def erlang_c(servers: int, load: float) -> float:
    """The chance that a request waits (M/M/c, ``servers`` slots, ``load`` busy slots offered)."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0  # Erlang B, grown one server at a time
    for c in range(1, servers + 1):
        b = load * b / (c + load * b)
    return servers * b / (servers - load * (1 - b))


def mean_queue(servers: int, load: float) -> float:
    """Requests waiting on average (M/M/c); infinite at or past saturation."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return math.inf
    return erlang_c(servers, load) * load / (servers - load)


def replicas_for(rate: float, capacity_rps: float, slots: int, budget_s: float, late: float,
                 most: int, wait_scale: float = 1.0) -> int:
    """The fewest replicas (at most ``most``) for which the model puts the share of requests waiting
    past ``budget_s`` at or under ``late`` (c = replicas x slots; ``wait_scale`` as in the docstring)."""
    if rate <= 0:
        return 0
    service = slots / capacity_rps  # mean seconds per request (Little's law on one replica)
    a = rate * service  # offered load in busy slots
    b = 1.0
    for c in range(1, most * slots + 1):
        b = a * b / (c + a * b)
        if c % slots or c <= a:
            continue
        wait = c * b / (c - a * (1 - b))  # Erlang C: P(a request waits at all)
        if wait * math.exp(-(c - a) / (service * wait_scale) * budget_s) <= late:
            return c // slots
    return most


class WaitCorrection:
    """Observed over predicted queue length, time-weighted, decaying (see the module's docstring)."""

    def __init__(self, prior_s: float = 2.0, memory_s: float = 600.0, lo: float = 0.25, hi: float = 2.0) -> None:
        self._prior, self._memory, self._lo, self._hi = prior_s, memory_s, lo, hi
        self._observed = 0.0  # queued request-seconds
        self._predicted = 0.0

    def observe(self, dt: float, queued: int, predicted: float) -> None:
        """``dt`` seconds with ``queued`` requests waiting, where the model predicted ``predicted``."""
        if dt <= 0 or not math.isfinite(predicted):
            return
        decay = math.exp(-dt / self._memory)
        self._observed = self._observed * decay + queued * dt
        self._predicted = self._predicted * decay + predicted * dt

    @property
    def factor(self) -> float:
        """How much longer (> 1) or shorter (< 1) waits are than the model says."""
        raw = (self._observed + self._prior) / (self._predicted + self._prior)
        return min(self._hi, max(self._lo, raw))
