"""Shared measurements for limiter accuracy tests (fake clock, real time, Redis).

"Limit" is checked the way a client would: the most admissions in any
half-open interval ``(t - window, t]`` of the admission log, and the share of
``limit`` per window admitted over the whole overload period.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["max_in_window", "throughput_share", "exact_admissions", "bucket_excess", "exact_bucket",
           "OVER", "UNDER"]

OVER = 1.005  # Done-when: never more than 0.5% above the limit
UNDER = 0.99  # ... and never below 99% of it under steady overload


def max_in_window(times: Sequence[float], window: float, weights: Sequence[float] | None = None) -> float:
    """Largest total admitted in any ``(t - window, t]``; the max is reached at an admission time."""
    order = sorted(range(len(times)), key=times.__getitem__)
    ts = [times[i] for i in order]
    ws = [1.0 if weights is None else weights[i] for i in order]
    best = run = 0.0
    j = 0
    for i, t in enumerate(ts):
        run += ws[i]
        while ts[j] <= t - window:
            run -= ws[j]
            j += 1
        best = max(best, run)
    return best


def exact_admissions(arrivals: Sequence[float], limit: int, window: float) -> list[float]:
    """What a perfect limiter (an exact sliding log) admits of ``arrivals``: the reference for
    real-time runs, where the machine decides when requests are offered."""
    from collections import deque

    log: deque[float] = deque()
    out = []
    for t in sorted(arrivals):
        while log and log[0] <= t - window:
            log.popleft()
        if len(log) < limit:
            log.append(t)
            out.append(t)
    return out


def throughput_share(count: float, limit: float, window: float, duration: float) -> float:
    """Admitted over ``duration`` as a share of what the limit allows in it."""
    return count / (limit * duration / window)


def bucket_excess(times: Sequence[float], rate: float) -> float:
    """Largest ``n - rate * (t_last - t_first)`` over runs of consecutive admissions: a token bucket
    of ``burst`` at ``rate`` admitted correctly iff this is at most ``burst`` (every interval holds
    at most ``burst + rate * length``)."""
    ts = sorted(times)
    best = 0.0
    low = float("inf")  # min over i <= j of (i - rate * t_i)
    for j, t in enumerate(ts):
        low = min(low, j - rate * t)
        best = max(best, (j + 1 - rate * t) - low)
    return best


def exact_bucket(arrivals: Sequence[float], rate: float, burst: float) -> list[float]:
    """What one perfect token bucket (full at the start) admits of ``arrivals``, one unit each."""
    level, at, out = burst, None, []
    for t in sorted(arrivals):
        if at is not None:
            level = min(burst, level + (t - at) * rate)
        at = t
        if level >= 1.0:
            level -= 1.0
            out.append(t)
    return out
