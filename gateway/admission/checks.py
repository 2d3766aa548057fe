"""The built-in admission checks, in the order :class:`~gateway.admission.gate.Admission` runs them:
refusing cheapest first, and each taking nothing when it refuses.

1. :class:`KeyCheck` -- the bearer key's record (401), then its model allow-list (403);
2. :class:`ShedCheck` -- the pool's bound for the request's priority class, its predicted wait
   against the deadline (503), the key's concurrency cap (429); the slot is taken in the same call;
3. :class:`RateCheck` -- every matching rate rule on requests and on tokens (prompt + max output,
   reserved), all-or-nothing (429 with ``x-ratelimit-*``); settled by the tokens used at release.

Each adapts a sans-I/O core that knows nothing of grants (:class:`KeyStore`,
:class:`LoadShedder`, :class:`RateLimits`) to the :class:`~gateway.admission.check.Check` protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import APIError
from .check import AdmissionContext, Grant
from .keys import KeyRecord, KeyStore
from .limiter import Limiter
from .limits import RateLimits, RateRule, Verdict
from .ratelimit_headers import refusal, render
from .rules import Admitted, LimiterTable, Step, step
from .shed import LoadShedder

__all__ = ["KeyCheck", "ShedCheck", "RateCheck"]


class KeyCheck:
    """Auth: the request's bearer key (401 without a valid one), allowed the model (403)."""

    __slots__ = ("keys",)
    name = "keys"

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        keys = self.keys
        if now >= keys.next_check:
            keys.maybe_reload(now)
        authorization = ctx.authorization
        rec = keys.seen.get(authorization) if authorization is not None else None  # a key seen before
        if rec is None:
            rec = keys.authenticate(authorization)
        if rec.models and ctx.model not in rec.models:
            raise APIError(403, f"This API key ({rec.id}) is not allowed to use the model '{ctx.model}'.",
                           "invalid_request_error", "model", "model_not_allowed")
        grant.key, grant.key_id, grant.priority = rec, rec.id, rec.priority

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        pass  # holds nothing

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        pass


class ShedCheck:
    """Load shedding: a slot in the model's pool for the request's class (the request's hint may
    lower its key's class, never raise it), within the key's concurrency cap."""

    __slots__ = ("shedder", "key_max_concurrency")
    name = "shed"

    def __init__(self, shedder: LoadShedder, key_max_concurrency: int = 0) -> None:
        self.shedder = shedder
        self.key_max_concurrency = key_max_concurrency  # every key's cap unless its record sets one

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        hint = ctx.priority
        if hint is not None and hint < grant.priority:
            grant.priority = hint
        rec = grant.key
        cap = rec.max_concurrency if rec is not None and rec.max_concurrency else self.key_max_concurrency
        grant.capped_key = self.shedder.take(grant.pool, grant.key_id, cap, grant.priority, ctx.deadline, now)

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        self.shedder.untake(grant.pool, grant.capped_key)  # the wait estimate is left as it was

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        self.shedder.leave(grant.pool, grant.capped_key, now)


class RateCheck:
    """Rate limits: the configured rules and the key's own (``limits`` in its record), on requests
    and on tokens; the tokens reserved are settled at release by the tokens used."""

    __slots__ = ("limits", "_limited", "_make", "_max_keys", "_key_tables", "_key_plans")
    name = "limits"

    def __init__(self, limits: RateLimits, make: Callable[[RateRule, str], Limiter], max_keys: int) -> None:
        self.limits = limits
        self._limited = bool(limits.rules)
        self._make = make
        self._max_keys = max_keys
        self._key_tables: dict[RateRule, LimiterTable] = {}  # per-key rules from key records
        self._key_plans: dict[str, tuple[tuple[RateRule, ...], tuple[Step, ...]]] = {}  # by key id

    def admit(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        extra = self._key_steps(grant.key)
        if self._limited or extra:
            grant.headers, grant.reservation = self.take(
                (grant.key_id, ctx.client, ctx.model, ctx.route), ctx.prompt_tokens + ctx.max_tokens, now, extra)

    def take(self, values: tuple[str | None, ...], tokens: float, now: float, extra: tuple[Step, ...] = ()
             ) -> Admitted:
        """Every matching rule's units (``values``: the scopes' values, ``limits.SCOPES`` order), or the
        429 with nothing taken; :meth:`admit`'s decision, and admit_call's when its plan is not it."""
        r = self.limits.take(values, tokens, now, extra)
        if isinstance(r, Verdict):
            raise refusal(r.wait, r.unit, render(r.requests, r.tokens))
        return r

    def undo(self, ctx: AdmissionContext, grant: Grant, now: float) -> None:
        extra = self._key_steps(grant.key)
        if self._limited or extra:
            self.limits.untake((grant.key_id, ctx.client, ctx.model, ctx.route), ctx.prompt_tokens + ctx.max_tokens,
                               now, extra)

    def release(self, grant: Grant, completion_tokens: int, now: float) -> None:
        self.limits.settle(grant.reservation, grant.prompt + completion_tokens, now)

    def tables(self) -> list[LimiterTable]:
        """Every table of limiters: the configured rules', then the keys' own rules' (tests, gauges)."""
        return [*self.limits.tables(), *self._key_tables.values()]

    def _key_steps(self, rec: KeyRecord | None) -> tuple[Step, ...]:
        """The plan steps of a key's own rules, built once per key record."""
        if rec is None or not rec.limits:
            return ()
        cached = self._key_plans.get(rec.id)
        if cached is not None and cached[0] is rec.limits:
            return cached[1]
        if len(self._key_plans) > self._max_keys:
            self._key_plans.clear()
        steps = tuple(step(r, self._key_table(r)) for r in rec.limits)
        self._key_plans[rec.id] = (rec.limits, steps)
        return steps

    def _key_table(self, rule: RateRule) -> LimiterTable:
        table = self._key_tables.get(rule)
        if table is None:
            table = self._key_tables[rule] = LimiterTable(lambda value: self._make(rule, value), self._max_keys)
        return table
