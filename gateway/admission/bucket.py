"""Token-bucket rate limiter: a sustained rate with a bounded burst.

How it works: the bucket holds up to ``burst`` units and refills continuously
at ``limit / window`` units per second; an admission of ``cost`` units needs
that many in the bucket and removes them. Over any interval of length T at
most ``burst + T * limit / window`` units are admitted, and under overload the
bucket admits exactly the refill rate (nothing is lost but float rounding).
It allows bursts the sliding window does not: pick it where a steady rate
matters and short bursts are harmless. State is two floats; it is refilled
lazily from the clock passed in, so no timer runs.
"""

from __future__ import annotations

import math

from .limiter import TakeAfterWait

__all__ = ["TokenBucketLimiter"]


class TokenBucketLimiter(TakeAfterWait):
    """``limit`` units per ``window`` seconds sustained, ``burst`` at once; sans-I/O."""

    __slots__ = ("limit", "window", "burst", "_rate", "_level", "_at")

    def __init__(self, limit: float, window: float, burst: float | None = None) -> None:
        if not limit > 0:
            raise ValueError(f"limit must be > 0, got {limit!r}")
        if not (window > 0 and math.isfinite(window)):
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        burst = limit if burst is None else burst
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst!r}")
        self.limit = float(limit)
        self.window = float(window)
        self.burst = float(burst)
        self._rate = self.limit / self.window
        self._level = self.burst  # starts full
        self._at = -math.inf

    def _refill(self, now: float) -> float:
        if now > self._at:
            self._level = min(self.burst, self._level + (now - self._at) * self._rate)
            self._at = now
        return self._level

    def used(self, now: float) -> float:
        return self.burst - self._refill(now)

    def remaining(self, now: float) -> float:
        return max(0.0, self._refill(now))

    def wait(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units are in the bucket (``inf``: more than it holds)."""
        if cost > self.burst:
            return math.inf
        level = self._refill(now)
        return 0.0 if cost <= level else (cost - level) / self._rate

    def take(self, cost: float, now: float) -> tuple[float, float]:
        self._refill(now)
        self._level -= cost
        return max(0.0, self._level), (self.burst - self._level) / self._rate

    def untake(self, cost: float, now: float) -> None:
        self._level = min(self.burst, self._level + cost)

    def refund(self, amount: float, at: float, now: float) -> None:
        """Give back an over-reservation (negative: charge more); capped at a full bucket."""
        del at
        self._refill(now)
        self._level = min(self.burst, self._level + amount)

    def reset_in(self, now: float) -> float:
        return (self.burst - self._refill(now)) / self._rate

    def status(self, now: float) -> tuple[float, float]:
        level = self._refill(now)
        return max(0.0, level), (self.burst - level) / self._rate

    def idle(self, now: float) -> bool:
        return self._refill(now) >= self.burst

    def latest(self) -> float:
        """The last time it was asked (it refills lazily from then)."""
        return self._at

    def __repr__(self) -> str:
        return f"TokenBucketLimiter(limit={self.limit:g}, window={self.window:g}, burst={self.burst:g})"
