"""A single-use store for 0-RTT anti-replay (RFC 8446 8.1, RFC 9001 9.2), sans-I/O.

How it works: :meth:`SingleUseStore.claim` records a key (a session ticket's
identity) until it expires and answers True only the first time. A key must be
remembered for as long as it could be presented again, so entries live until
``expires_at`` and the store never forgets one early: once ``capacity``
unexpired keys are held, new claims are refused (the caller then does a full
handshake, which is safe) instead of evicting a key that could be replayed.
Expired entries are dropped as time passes; the clock is an argument.
"""

from __future__ import annotations

import heapq

__all__ = ["SingleUseStore"]


class SingleUseStore:
    """Keys that may be used once each, remembered until they expire."""

    __slots__ = ("capacity", "_expiry", "_heap", "refused")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []
        self.refused = 0  # claims refused because the store was full

    def __len__(self) -> int:
        return len(self._expiry)

    def claim(self, key: bytes, expires_at: float, now: float) -> bool:
        """True if ``key`` was not claimed before (and is now, until ``expires_at``)."""
        self.expire(now)
        if key in self._expiry:
            return False
        if expires_at <= now:
            return False  # already past its lifetime: never usable
        if len(self._expiry) >= self.capacity:
            self.refused += 1
            return False
        self._expiry[key] = expires_at
        heapq.heappush(self._heap, (expires_at, key))
        return True

    def expire(self, now: float) -> None:
        """Forget keys whose lifetime has ended (they can no longer be presented)."""
        heap, expiry = self._heap, self._expiry
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            expiry.pop(key, None)
