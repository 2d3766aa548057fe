"""The admission stage's façade: one synchronous ``admit`` per request, one ``release`` at its end.

How it works: ``admit`` runs, in order, the checks that refuse cheapest
first and that must not leave anything taken when a later one refuses:

1. auth -- the bearer key's record (401), then its model allow-list (403);
2. load shedding -- pool bound for the request's priority class, predicted
   wait against the deadline (503), the key's concurrency cap (429); the slot
   is taken in the same call (one dict lookup on the usual path);
3. rate limits -- every matching rule on requests and on tokens (prompt +
   max output, reserved), all-or-nothing (429 with ``x-ratelimit-*``); a
   refusal gives the shedding slot back (``untake``: the wait estimate is
   left as it was), so a refused request holds nothing;
4. a :class:`Grant` returned.

``release`` settles the token reservation by the tokens actually used and
frees the slot; a grant released twice is a bug in the caller and raises.
Nothing here awaits or starts a task: with Redis-shared limits the limiters
spend local leases and a separate refresher keeps them topped up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import APIError
from .config import AdmissionSettings, parse_rule
from .keys import KeyRecord, KeyStore
from .limiter import Limiter
from .limits import (
    DEFAULT_MAX_KEYS,
    Admitted,
    LimiterTable,
    RateLimits,
    RateRule,
    Reservation,
    Step,
    Verdict,
    local_limiter,
    step,
)
from .ratelimit_headers import Headers, refusal, render
from .shed import DEFAULT_PRIORITY, LoadShedder

if TYPE_CHECKING:
    from ..api.params import GenerationRequest
    from ..http.types import Request

__all__ = ["Admission", "AdmissionContext", "Grant", "GrantInfo", "PRIORITY_OF_TIER"]

# OpenAI's service_tier as a priority hint (it may lower a key's class, never raise it)
PRIORITY_OF_TIER = {"flex": 0, "default": 1, "auto": 1, "priority": 2}


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """What admission needs of a request; ``authorization`` is the raw header value, never logged."""

    authorization: bytes | None
    client: str | None  # client address
    model: str
    route: str
    prompt_tokens: int  # estimate
    max_tokens: int  # output tokens the request may generate
    deadline: float | None = None  # seconds from now
    priority: int | None = None  # hint from the request; may lower the key's class, never raise it

    def __repr__(self) -> str:
        auth = "None" if self.authorization is None else "<redacted>"
        return (f"AdmissionContext(authorization={auth}, client={self.client!r}, model={self.model!r}, "
                f"route={self.route!r}, prompt_tokens={self.prompt_tokens}, max_tokens={self.max_tokens}, "
                f"deadline={self.deadline!r}, priority={self.priority!r})")


Grant = list[Any]
"""An admitted request: ``[key_id, priority, headers, reservation, pool, capped_key, released,
prompt]`` (:class:`GrantInfo` names the fields). A list because one is built per request and a
list is the cheapest object to build; ``released`` turns True at release, which makes a second
release an error."""


class GrantInfo(NamedTuple):
    """A grant's fields by name (tests, diagnostics): ``GrantInfo(*grant)``."""

    key_id: str | None  # who (a key id, never the key)
    priority: int  # its shedding class
    headers: tuple[tuple[bytes, bytes], ...]  # x-ratelimit-* for the response
    reservation: Reservation | None  # the tokens reserved, settled at release
    pool: str
    capped_key: str | None  # the key id when its concurrency is capped
    released: bool
    prompt: int  # the prompt-size estimate reserved with the output (release_completion adds it back)


class Admission:
    """Auth + rate limits + load shedding for the request pipeline; sans-I/O, ``now`` passed in."""

    __slots__ = ("keys", "auth_required", "limits", "shedder", "default_priority", "key_max_concurrency",
                 "_key_tables", "_key_plans", "_max_keys", "_make", "_limited", "_plain_bound")

    def __init__(self, keys: KeyStore | None, limits: RateLimits, shedder: LoadShedder, *,
                 auth_required: bool, default_priority: int = DEFAULT_PRIORITY, key_max_concurrency: int = 0,
                 make: Callable[[RateRule, str], Limiter] = local_limiter,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if auth_required and keys is None:
            raise ValueError("auth_required needs a KeyStore")
        self.keys = keys
        self.auth_required = auth_required
        self.limits = limits
        self.shedder = shedder
        self.default_priority = default_priority
        self.key_max_concurrency = key_max_concurrency
        self._key_tables: dict[RateRule, LimiterTable] = {}  # per-key rules from key records
        self._key_plans: dict[str, tuple[tuple[RateRule, ...], tuple[Step, ...]]] = {}  # by key id
        self._limited = bool(limits.rules)
        # admit_call's plain case: a pool holding fewer than the lowest class's bound admits any class
        self._plain_bound = shedder.bound(0)
        self._max_keys = max_keys
        self._make = make

    @classmethod
    def from_settings(cls, s: AdmissionSettings,
                      make: Callable[[RateRule, str], Limiter] = local_limiter) -> Admission:
        """Build from ``[admission]`` (already validated); ``make`` swaps in Redis-leased limiters."""
        keys = KeyStore(s.keys, s.keys_file, s.keys_check_interval) if (s.keys or s.keys_file) else None
        required = s.auth == "on" or (s.auth == "auto" and keys is not None)
        rules = [parse_rule(t) for t in s.limits]
        shedder = LoadShedder(s.queue_limit, s.priority_classes, s.priority_headroom)
        return cls(keys, RateLimits(rules, make, s.limiter_max_keys), shedder, auth_required=required,
                   default_priority=s.default_priority, key_max_concurrency=s.key_max_concurrency,
                   make=make, max_keys=s.limiter_max_keys)

    def admit(self, ctx: AdmissionContext, now: float) -> Grant:
        """A :class:`Grant`, or :class:`APIError` (401, 403, 429, 503) with nothing held."""
        return self.admit_request(ctx.authorization, ctx.client, ctx.model, ctx.route, ctx.prompt_tokens,
                                  ctx.max_tokens, ctx.priority, now, ctx.deadline)

    def admit_call(self, req: Request, g: GenerationRequest, now: float, deadline: float | None = None) -> Grant:
        """The pipeline's admit: :meth:`admit_request` for a parsed request, its usual case written
        out in this one frame -- a key seen before, with no cap or rules of its own, allowed the
        model; a pool below even the lowest class's bound; no deadline. Anything else is decided
        by :meth:`admit_request` (tests/gateway/admission/test_admit_call.py drives both with the
        same random requests and asserts the same answers and state). ``deadline``: seconds the
        request may still take (gRPC's ``grpc-timeout``), None for none of its own."""
        model = g.model
        prompt = g.prompt_tokens
        if prompt < 0:
            prompt = g.prompt_estimate()
        tier = g.service_tier
        hint = None if tier is None else PRIORITY_OF_TIER.get(tier)
        authorization: bytes | None = None
        key_id: str | None = None
        priority = self.default_priority
        plain = deadline is None and not self.key_max_concurrency
        if self.auth_required:
            for name, value in req.headers:
                if name == b"authorization":
                    authorization = value
                    break
            keys = self.keys
            assert keys is not None
            rec = keys.seen.get(authorization) if authorization is not None else None
            if rec is None or now >= keys.next_check or rec.max_concurrency or rec.limits or (
                    rec.models and model not in rec.models):
                plain = False
            else:
                key_id, priority = rec.id, rec.priority
        if hint is not None and hint < priority:
            priority = hint
        st = self.shedder.pools.get(model)
        client = req.client
        if not plain or st is None or st.outstanding >= self._plain_bound:
            return self.admit_request(authorization, None if client is None else client[0], model, req.path,
                                      prompt, g.params.max_tokens, hint, now, deadline)
        self.shedder.enter_plain(st, now)  # the shedder's take, its plain case: a slot in a pool with room
        headers: Headers = ()
        reservation: Reservation | None = None
        if self._limited:
            limits = self.limits
            address = None if client is None else client[0]
            tokens = prompt + g.params.max_tokens
            fast = limits.fast(key_id, address, model, req.path, tokens, now)  # the usual case, compiled
            if fast is None:  # not the usual case: take decides
                fast = self._take((key_id, address, model, req.path), tokens, now, (), model, None)
            headers, reservation = fast
        return [key_id, priority, headers, reservation, model, None, False, prompt]

    def admit_request(self, authorization: bytes | None, client: str | None, model: str, route: str,
                      prompt: int, max_tokens: int, hint: int | None, now: float,
                      deadline: float | None = None) -> Grant:
        """:meth:`admit` without building an :class:`AdmissionContext` (the pipeline's call):
        ``prompt`` the prompt-size estimate, ``max_tokens`` the output tokens the request may
        generate (both are reserved on token rules), ``hint`` the request's priority hint."""
        key_id: str | None = None
        priority = self.default_priority
        cap = self.key_max_concurrency
        extra: tuple[Step, ...] = ()
        if self.auth_required:
            keys = self.keys
            assert keys is not None
            if now >= keys.next_check:
                keys.maybe_reload(now)
            rec = keys.seen.get(authorization) if authorization is not None else None  # a key seen before
            if rec is None:
                rec = keys.authenticate(authorization)
            if rec.models and model not in rec.models:
                raise APIError(403, f"This API key ({rec.id}) is not allowed to use the model '{model}'.",
                               "invalid_request_error", "model", "model_not_allowed")
            key_id, priority = rec.id, rec.priority
            if rec.max_concurrency:
                cap = rec.max_concurrency
            if rec.limits:
                extra = self._key_steps(rec)
        if hint is not None and hint < priority:
            priority = hint
        capped = self.shedder.take(model, key_id, cap, priority, deadline, now)  # 503/429 with nothing held
        headers: Headers = ()
        reservation: Reservation | None = None
        if self._limited or extra:
            headers, reservation = self._take((key_id, client, model, route), prompt + max_tokens, now, extra, model,
                                              capped)
        return [key_id, priority, headers, reservation, model, capped, False, prompt]

    def _take(self, values: tuple[str | None, ...], tokens: float, now: float, extra: tuple[Step, ...], pool: str,
              capped: str | None) -> Admitted:
        """The rate limits' answer for a request that holds a shedding slot: on a refusal (or a
        shared store that cannot decide, fail-closed) the slot is given back and the 429 raised."""
        try:
            r = self.limits.take(values, tokens, now, extra)
        except APIError:
            self.shedder.untake(pool, capped)
            raise
        if isinstance(r, Verdict):
            self.shedder.untake(pool, capped)
            raise refusal(r.wait, r.unit, render(r.requests, r.tokens))
        return r

    def release(self, grant: object, used_tokens: int, now: float) -> None:
        """At the request's end, exactly once: settle tokens by actual use, free the slot (``grant``:
        what :meth:`admit` returned; typed ``object`` so the pipeline can call this directly)."""
        if type(grant) is not list:
            raise TypeError(f"not an admission grant: {grant!r}")
        self.release_completion(grant, used_tokens - grant[7], now)

    def release_completion(self, grant: object, completion_tokens: int, now: float) -> None:
        """:meth:`release` told only the completion tokens (the pipeline's call): the use settled
        is the reserved prompt estimate plus them."""
        if type(grant) is not list:
            raise TypeError(f"not an admission grant: {grant!r}")
        _, _, _, res, pool, capped, released, prompt = grant
        if released:
            raise RuntimeError("admission grant released twice")
        grant[6] = True
        if res is not None:
            reserved, at, limiters = res
            over = reserved - prompt - completion_tokens
            if over != 0.0:
                for lim in limiters:
                    lim.refund(over, at, now)
        self.shedder.leave(pool, capped, now)

    def reload_keys(self) -> list[str]:
        """Re-read the key file now (SIGHUP); the problems, if any, with the old keys kept."""
        return [] if self.keys is None else self.keys.reload()

    def outstanding(self) -> int:
        """Requests admitted and not yet released (each holds a slot in its pool)."""
        return sum(st.outstanding for st in self.shedder.pools.values())

    def _key_steps(self, rec: KeyRecord) -> tuple[Step, ...]:
        """The plan steps of a key's own rules, built once per key record."""
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
