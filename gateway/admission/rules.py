"""Rate rules and where their limiters live, shared by :mod:`.limits` (which decides every case)
and :mod:`.plan` (which compiles the usual one): :class:`RateRule`, :class:`LimiterTable`, a
rule's plan :data:`Step`, and what an admission answers (:data:`Admitted`, :data:`Reservation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .bucket import TokenBucketLimiter
from .limiter import Limiter
from .ratelimit_headers import Headers, limit_pair, reset_pair
from .window import DEFAULT_SLICES, SlidingWindowLimiter

__all__ = ["RateRule", "LimiterTable", "Reservation", "Step", "Admitted", "SCOPES", "UNITS", "ALGORITHMS",
           "DEFAULT_MAX_KEYS", "local_limiter", "step"]

SCOPES = ("key", "client", "model", "route")
DEFAULT_MAX_KEYS = 100_000  # limiters kept per rule; idle ones are evicted first
UNITS = ("requests", "tokens")
ALGORITHMS = ("window", "bucket")


@dataclass(frozen=True, slots=True)
class RateRule:
    """``limit`` ``unit`` per ``window`` seconds for each value of ``scope`` (or only ``match``)."""

    scope: str
    unit: str
    limit: float
    window: float
    algorithm: str = "window"
    slices: int = DEFAULT_SLICES
    burst: float = 0.0  # token bucket capacity; 0 = limit
    match: str = "*"  # "*" = every value separately; else only this value

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        p = []
        if self.scope not in SCOPES:
            p.append(f"scope {self.scope!r} is not one of {', '.join(SCOPES)}")
        if self.unit not in UNITS:
            p.append(f"unit {self.unit!r} is not one of {', '.join(UNITS)}")
        if self.algorithm not in ALGORITHMS:
            p.append(f"algorithm {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if not (self.limit > 0 and math.isfinite(self.limit)):
            p.append(f"limit must be > 0, got {self.limit!r}")
        if not (self.window > 0 and math.isfinite(self.window)):
            p.append(f"window must be > 0 seconds, got {self.window!r}")
        if self.slices < 1:
            p.append(f"slices must be >= 1, got {self.slices!r}")
        if self.burst < 0:
            p.append(f"burst must be >= 0, got {self.burst!r}")
        return p


def local_limiter(rule: RateRule, value: str) -> Limiter:
    """The in-process limiter a rule asks for (``value``, the scope's value, is not needed locally)."""
    del value
    if rule.algorithm == "bucket":
        return TokenBucketLimiter(rule.limit, rule.window, rule.burst or None)
    return SlidingWindowLimiter(rule.limit, rule.window, rule.slices)


class LimiterTable:
    """Limiters by scope value, at most ``max_keys``; idle ones are dropped first, then one unused
    for longest (approximately: second chance).

    A hit is one plain dict lookup: nothing is recorded per use (an ``OrderedDict.move_to_end`` per
    rule per request was most of the cost of a lookup). Recency comes from the limiters
    themselves instead: each entry remembers when it was put at the back (``_since``), and when
    the front one is reached on a miss it is dropped if it is idle or has not been used since
    (``latest()``), else moved to the back for a second chance (CLOCK). The front thus drifts to
    the entries unused for longest, and a miss costs amortised O(1).
    """

    __slots__ = ("_make", "_max", "items", "_since", "evicted_busy")

    def __init__(self, make: Callable[[str], Limiter], max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self._make = make
        self._max = max_keys
        self.items: dict[str, Limiter] = {}
        self._since: dict[str, float] = {}  # when each entry was put at the back
        self.evicted_busy = 0  # limiters dropped while still counting (their clients got a fresh window)

    def get(self, value: str, now: float) -> Limiter:
        lim = self.items.get(value)
        if lim is not None:
            return lim
        self._sweep(now)
        if len(self.items) >= self._max:
            self._evict(now)
        lim = self.items[value] = self._make(value)
        self._since[value] = now
        return lim

    def _sweep(self, now: float, budget: int = 8) -> None:
        """Drop up to ``budget`` idle limiters from the front: amortised, no timer."""
        items = self.items
        while budget and items:
            value = next(iter(items))
            if not items[value].idle(now):
                return
            del items[value], self._since[value]
            budget -= 1

    def _evict(self, now: float, budget: int = 64) -> None:
        """Make room for one: the first entry from the front unused since it was put at the back
        (within ``budget``; else the front one)."""
        items, since = self.items, self._since
        while True:
            value = next(iter(items))
            lim = items.pop(value)
            put = since.pop(value)
            budget -= 1
            if lim.latest() <= put or lim.idle(now) or not budget:
                if not lim.idle(now):
                    self.evicted_busy += 1
                return
            items[value] = lim
            since[value] = now

    def __len__(self) -> int:
        return len(self.items)


Reservation = tuple[float, float, tuple[Limiter, ...]]
"""(reserved, at, limiters): token units taken at ``at`` from ``limiters``, to be settled by actual
use. A plain tuple: one is built per request, and a NamedTuple's construction and attribute reads
cost several times a tuple's."""


Step = tuple[int, str | None, Callable[[str], "Limiter | None"], LimiterTable, bool, tuple[bytes, bytes], float,
             tuple[bytes, bytes], RateRule]
"""One rule as the hot loop reads it: (index of its scope in the values tuple, the value it is
limited to or None for every value, its table's bound dict ``get``, the table,
whether it counts tokens, its ``x-ratelimit-limit-*`` header, its window and the
``x-ratelimit-reset-*`` header of a window that resets in full -- what a sliding window answers
whenever the request is its newest admission --, the rule)."""

Admitted = tuple[Headers, Reservation | None]


def step(rule: RateRule, table: LimiterTable) -> Step:
    """The plan step of ``rule`` with its limiters in ``table``."""
    tokens = rule.unit == "tokens"
    return (SCOPES.index(rule.scope), None if rule.match == "*" else rule.match, table.items.get, table, tokens,
            limit_pair(rule.unit, rule.limit), rule.window, reset_pair(rule.window, tokens), rule)
