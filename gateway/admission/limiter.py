"""The limiter interface every rate limiter implements (local or Redis-leased), and the
generic two-step ``try_take`` for limiters without a faster one of their own."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Limiter", "TakeAfterWait"]


class Limiter(Protocol):
    """What :class:`RateLimits` needs of a limiter (local, or a Redis lease)."""

    limit: float

    def wait(self, cost: float, now: float) -> float: ...
    def take(self, cost: float, now: float) -> tuple[float, float]: ...  # -> status() after taking
    def try_take(self, cost: float, now: float) -> tuple[float, float, float]: ...  # (wait, *status)
    def untake(self, cost: float, now: float) -> None: ...  # undo the take just made at ``now``
    def refund(self, amount: float, at: float, now: float) -> None: ...
    def remaining(self, now: float) -> float: ...
    def reset_in(self, now: float) -> float: ...
    def status(self, now: float) -> tuple[float, float]: ...  # (remaining, reset_in) in one pass
    def idle(self, now: float) -> bool: ...
    def latest(self) -> float: ...  # when it was last used (admitted, for the local ones; -inf: never)


class TakeAfterWait:
    """``try_take`` as :meth:`wait` then :meth:`take` (the sliding window has a fused one)."""

    __slots__ = ()

    def try_take(self: Limiter, cost: float, now: float) -> tuple[float, float, float]:
        w = self.wait(cost, now)
        if w > 0.0:
            return w, 0.0, 0.0
        rem, reset = self.take(cost, now)
        return 0.0, rem, reset
