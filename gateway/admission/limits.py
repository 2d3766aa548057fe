"""Rate-limit rules applied to a request: one limiter per (rule, scope value).

How it works: a :class:`RateRule` names a scope (the API key, the client
address, the model or the route), a unit (requests or tokens) and a limit per
window. :class:`RateLimits` keeps, per rule, a :class:`LimiterTable` of
limiters keyed by the scope's value (each key, each client...). ``check``
asks every matching limiter how long the request would wait and only when
all say 0 does it take the units from each -- a refused request consumes
nothing anywhere. Token rules reserve prompt + max output tokens up front;
the :class:`Reservation` returned remembers where, so ``settle`` can correct
by the tokens actually used. Tables are bounded (second-chance eviction) and drop idle limiters
first, so memory stays bounded whatever the number of clients. ``take`` decides every case; its
usual one is also compiled per rule set (:attr:`RateLimits.fast`, :mod:`.plan`), which the
pipeline tries first. The rules, tables and plan steps are defined in :mod:`.rules` (which
:mod:`.plan` imports too) and named here as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..errors import APIError
from .limiter import Limiter
from .plan import Plan, compile_plan
from .ratelimit_headers import REMAINING_REQUESTS, REMAINING_TOKENS, Headers, format_reset, reset_pair
from .rules import (
    DEFAULT_MAX_KEYS,
    SCOPES,
    UNITS,
    Admitted,
    LimiterTable,
    RateRule,
    Reservation,
    Step,
    local_limiter,
    step,
)

__all__ = [
    "RateRule", "LimiterTable", "RateLimits", "Reservation", "Verdict", "Step", "Admitted", "SCOPES", "UNITS",
    "local_limiter", "format_reset", "step", "DEFAULT_MAX_KEYS",
]


class Verdict(NamedTuple):
    """A refusal (``wait`` > 0), or what :meth:`RateLimits.check` answers; ``wait`` 0 means admitted.

    ``requests`` and ``tokens`` are the tightest (limit, remaining, reset seconds) of each unit,
    for OpenAI's ``x-ratelimit-*`` headers; ``None`` when no rule of that unit applied (and in
    :meth:`RateLimits.check`'s answer for an admitted request: :meth:`RateLimits.take` renders them).
    """

    wait: float
    unit: str  # the unit of the rule that refused ("" when admitted)
    requests: tuple[float, float, float] | None
    tokens: tuple[float, float, float] | None
    reservation: Reservation | None


_INF = math.inf


class RateLimits:
    """Every rule's limiters; ``take`` admits all-or-nothing, ``settle`` corrects tokens."""

    __slots__ = ("rules", "_tables", "_plan", "fast")

    def __init__(self, rules: Sequence[RateRule], make: Callable[[RateRule, str], Limiter] = local_limiter,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.rules = tuple(rules)
        self._tables = tuple(LimiterTable(_bind(make, r), max_keys) for r in self.rules)
        self._plan = tuple(step(r, t) for r, t in zip(self.rules, self._tables, strict=True))
        # the usual case of take (no extra steps), compiled: None when it is not (nothing taken)
        self.fast: Plan = compile_plan(self._plan, SCOPES)

    def take(self, values: Sequence[str | None], tokens: float, now: float,
             extra: tuple[Step, ...] = ()) -> Admitted | Verdict:
        """Admit one request of ``tokens`` (prompt + max output) if every matching rule allows it:
        its ``x-ratelimit-*`` headers and token reservation; else the refusal :class:`Verdict`, with
        nothing taken anywhere.

        ``values`` holds this request's value of each scope in :data:`SCOPES` order (``None``: the
        scope does not apply). ``extra`` adds steps, e.g. a key's own limits. Nothing is allocated
        per rule but the limiter's answer: the tightest rule of each unit is tracked in locals.
        """
        req_rem = tok_rem = _INF
        req_reset = tok_reset = 0.0
        req_s = tok_s = _NO_STEP
        held: tuple[Limiter, ...] = ()
        for s in (self._plan + extra) if extra else self._plan:
            idx, match, get, table, on_tokens, _, _, _, _ = s
            value = values[idx]
            if value is None or (match is not None and match != value):
                continue
            lim = get(value)
            if lim is None:
                lim = table.get(value, now)
            try:
                w, rem, reset = lim.try_take(tokens if on_tokens else 1.0, now)  # optimistic: usually yes
            except APIError:  # a limiter that cannot decide (shared store down, fail-closed)
                self._undo(s, values, tokens, now, extra)
                raise
            if w > 0.0:
                self._undo(s, values, tokens, now, extra)
                return self._refusal(values, tokens, now, extra)
            if on_tokens:
                held += (lim,)
                if rem < tok_rem:
                    tok_rem = rem
                    tok_reset = reset
                    tok_s = s
            elif rem < req_rem:
                req_rem = rem
                req_reset = reset
                req_s = s
        if req_rem != _INF:
            req_r = req_s[7] if req_reset == req_s[6] else reset_pair(req_reset, False)
            if tok_rem != _INF:
                h: Headers = (req_s[5], (REMAINING_REQUESTS, b"%d" % req_rem), req_r, tok_s[5],
                              (REMAINING_TOKENS, b"%d" % tok_rem),
                              tok_s[7] if tok_reset == tok_s[6] else reset_pair(tok_reset, True))
            else:
                h = (req_s[5], (REMAINING_REQUESTS, b"%d" % req_rem), req_r)
        elif tok_rem != _INF:
            h = (tok_s[5], (REMAINING_TOKENS, b"%d" % tok_rem),
                 tok_s[7] if tok_reset == tok_s[6] else reset_pair(tok_reset, True))
        else:
            return _NOTHING
        return h, ((tokens, now, held) if held else None)

    def check(self, values: dict[str, str | None], tokens: float, now: float,
              extra: Sequence[tuple[RateRule, LimiterTable, str]] = ()) -> Verdict:
        """:meth:`take` with the scopes by name and a :class:`Verdict` either way (tests, benchmarks).

        ``extra`` adds (rule, table, value) triples of scope ``key``; ``values["key"]`` is their value.
        """
        if extra:
            values = {**values, "key": extra[0][2]}
        r = self.take(tuple(values.get(sc) for sc in SCOPES), tokens, now, tuple(step(x[0], x[1]) for x in extra))
        if isinstance(r, Verdict):
            return r
        return Verdict(0.0, "", None, None, r[1])

    def _matching(self, values: Sequence[str | None], now: float, extra: tuple[Step, ...]
                  ) -> list[tuple[Step, Limiter]]:
        return [(s, s[3].get(values[s[0]], now)) for s in (self._plan + extra)  # type: ignore[arg-type]
                if values[s[0]] is not None and (s[1] is None or s[1] == values[s[0]])]

    def _undo(self, refused: Step, values: Sequence[str | None], tokens: float, now: float,
              extra: tuple[Step, ...]) -> None:
        """Give back what the steps before ``refused`` took from their limiters."""
        for s, lim in self._matching(values, now, extra):
            if s is refused:
                return
            lim.untake(tokens if s[4] else 1.0, now)

    def untake(self, values: Sequence[str | None], tokens: float, now: float, extra: tuple[Step, ...] = ()) -> None:
        """Give back all that the :meth:`take` just made at ``now`` took (a later check refused the request)."""
        for s, lim in self._matching(values, now, extra):
            lim.untake(tokens if s[4] else 1.0, now)

    def _refusal(self, values: Sequence[str | None], tokens: float, now: float,
                 extra: tuple[Step, ...]) -> Verdict:
        """A rule said no (nothing is held any more): the longest wait, and the headers' figures."""
        picked = [(s[8], lim, tokens if s[4] else 1.0) for s, lim in self._matching(values, now, extra)]
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
        reserved, at, limiters = reservation
        over = reserved - used_tokens
        if over != 0.0:
            for lim in limiters:
                lim.refund(over, at, now)

    def tables(self) -> tuple[LimiterTable, ...]:
        """Each rule's limiters, in rule order."""
        return self._tables

    def sizes(self) -> tuple[int, ...]:
        """Limiters held per rule (for the bounded-memory assertion and a gauge)."""
        return tuple(len(t) for t in self._tables)

    def evicted_busy(self) -> int:
        """Limiters dropped from a full table while still counting, over every rule."""
        return sum(t.evicted_busy for t in self._tables)


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


_NOTHING: Admitted = ((), None)
_NO_RULE = RateRule("route", "requests", 1.0, 1.0)
_NO_STEP = step(_NO_RULE, LimiterTable(_bind(local_limiter, _NO_RULE), 1))  # "no rule of this unit yet"
