"""Rate-limit rules applied to a request: one limiter per (rule, scope value).

How it works: a :class:`RateRule` names a scope (the API key, the client
address, the model or the route), a unit (requests or tokens) and a limit per
window. :class:`RateLimits` keeps, per rule, a :class:`LimiterTable` of
limiters keyed by the scope's value (each key, each client...). ``check``
asks every matching limiter how long the request would wait and only when
all say 0 does it take the units from each -- a refused request consumes
nothing anywhere. Token rules reserve prompt + max output tokens up front;
the :class:`Reservation` returned remembers where, so ``settle`` can correct
by the tokens actually used. Tables are LRU-bounded and drop idle limiters
first, so memory stays bounded whatever the number of clients.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import APIError
from .bucket import TokenBucketLimiter
from .limiter import Limiter
from .window import DEFAULT_SLICES, SlidingWindowLimiter

__all__ = [
    "RateRule", "LimiterTable", "RateLimits", "Reservation", "Verdict", "SCOPES", "UNITS",
    "local_limiter", "format_reset", "DEFAULT_MAX_KEYS",
]

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
    """Limiters by scope value, at most ``max_keys``; idle ones are dropped first, then the LRU."""

    __slots__ = ("_make", "_max", "_items", "evicted_busy")

    def __init__(self, make: Callable[[str], Limiter], max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self._make = make
        self._max = max_keys
        self._items: OrderedDict[str, Limiter] = OrderedDict()
        self.evicted_busy = 0  # limiters dropped while still counting (their clients got a fresh window)

    def get(self, value: str, now: float) -> Limiter:
        lim = self._items.get(value)
        if lim is not None:
            self._items.move_to_end(value)
            return lim
        self._sweep(now)
        if len(self._items) >= self._max:
            _, old = self._items.popitem(last=False)
            if not old.idle(now):
                self.evicted_busy += 1
        lim = self._items[value] = self._make(value)
        return lim

    def _sweep(self, now: float, budget: int = 8) -> None:
        """Drop up to ``budget`` idle limiters from the LRU end: amortised, no timer."""
        items = self._items
        while budget and items:
            value, lim = next(iter(items.items()))
            if not lim.idle(now):
                return
            del items[value]
            budget -= 1

    def __len__(self) -> int:
        return len(self._items)


class Reservation(NamedTuple):
    """Token units taken at ``at`` from ``limiters``, to be settled by actual use (a NamedTuple:
    one per request, see :class:`Verdict`)."""

    reserved: float
    at: float
    limiters: tuple[Limiter, ...]


class Verdict(NamedTuple):
    """The outcome of :meth:`RateLimits.check`: ``wait`` 0 means admitted.

    A NamedTuple rather than a frozen dataclass: one is built per request on the hot path, and a
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs several times more.

    ``requests`` and ``tokens`` are the tightest (limit, remaining, reset seconds) of each unit,
    for OpenAI's ``x-ratelimit-*`` headers; ``None`` when no rule of that unit applied.
    """

    wait: float
    unit: str  # the unit of the rule that refused ("" when admitted)
    requests: tuple[float, float, float] | None
    tokens: tuple[float, float, float] | None
    reservation: Reservation | None


class RateLimits:
    """Every rule's limiters; ``check`` admits all-or-nothing, ``settle`` corrects tokens."""

    __slots__ = ("rules", "_tables", "_plan")

    def __init__(self, rules: Sequence[RateRule], make: Callable[[RateRule, str], Limiter] = local_limiter,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.rules = tuple(rules)
        self._tables = tuple(LimiterTable(_bind(make, r), max_keys) for r in self.rules)
        # what the hot loop needs per rule, without attribute lookups
        self._plan = tuple((r.scope, r.match, r, t) for r, t in zip(self.rules, self._tables, strict=True))

    def check(self, values: dict[str, str | None], tokens: float, now: float,
              extra: Sequence[tuple[RateRule, LimiterTable, str]] = ()) -> Verdict:
        """Admit one request of ``tokens`` (prompt + max output) if every matching rule allows it.

        ``values`` maps each scope to this request's value (``None``: the scope does not apply).
        ``extra`` adds (rule, table, value) triples, e.g. a key's own limits.
        """
        taken: list[tuple[Limiter, float]] = []
        held: list[Limiter] = []
        req: tuple[float, float, float] | None = None
        tok: tuple[float, float, float] | None = None
        todo = [(rule, table, value) for scope, match, rule, table in self._plan
                if (value := values.get(scope)) is not None and (match == "*" or match == value)]
        todo += extra
        for rule, table, value in todo:
            lim = table.get(value, now)
            on_tokens = rule.unit == "tokens"
            cost = tokens if on_tokens else 1.0
            try:
                w, rem, reset = lim.try_take(cost, now)  # optimistic: the usual answer is yes
            except APIError:  # a limiter that cannot decide (shared store down, fail-closed)
                for done, c in taken:
                    done.untake(c, now)
                raise
            if w > 0.0:
                return self._refuse(taken, todo, tokens, now)
            taken.append((lim, cost))
            if on_tokens:
                held.append(lim)
                if tok is None or rem < tok[1]:
                    tok = (rule.limit, rem, reset)
            elif req is None or rem < req[1]:
                req = (rule.limit, rem, reset)
        if not taken:
            return _NOTHING
        return Verdict(0.0, "", req, tok, Reservation(tokens, now, tuple(held)) if held else None)

    @staticmethod
    def _refuse(taken: list[tuple[Limiter, float]], todo: list[tuple[RateRule, LimiterTable, str]],
                tokens: float, now: float) -> Verdict:
        """A rule said no: undo what was taken, then work out the longest wait and the headers."""
        for lim, cost in taken:
            lim.untake(cost, now)
        picked = [(rule, table.get(value, now), tokens if rule.unit == "tokens" else 1.0)
                  for rule, table, value in todo]
        worst, unit = 0.0, ""
        for rule, lim, cost in picked:
            w = lim.wait(cost, now)
            if w > worst:
                worst, unit = w, rule.unit
        return Verdict(worst, unit, *_tightest(picked, now), None)

    @staticmethod
    def settle(reservation: Reservation | None, used_tokens: float, now: float) -> None:
        """Correct a reservation by the tokens actually used (once, at the request's end)."""
        if reservation is None:
            return
        over = reservation.reserved - used_tokens
        if over != 0.0:
            for lim in reservation.limiters:
                lim.refund(over, reservation.at, now)

    def sizes(self) -> tuple[int, ...]:
        """Limiters held per rule (for the bounded-memory assertion and a gauge)."""
        return tuple(len(t) for t in self._tables)


def _bind(make: Callable[[RateRule, str], Limiter], rule: RateRule) -> Callable[[str], Limiter]:
    return lambda value: make(rule, value)


def _tightest(picked: list[tuple[RateRule, Limiter, float]], now: float
              ) -> tuple[tuple[float, float, float] | None, tuple[float, float, float] | None]:
    req: tuple[float, float, float] | None = None
    tok: tuple[float, float, float] | None = None
    for rule, lim, _ in picked:
        rem, reset = lim.status(now)
        if rule.unit == "requests":
            if req is None or rem < req[1]:
                req = (rule.limit, rem, reset)
        elif tok is None or rem < tok[1]:
            tok = (rule.limit, rem, reset)
    return req, tok


_NOTHING = Verdict(0.0, "", None, None, None)


def format_reset(seconds: float) -> str:
    """OpenAI's duration form for ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    total = math.ceil(seconds)
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"
