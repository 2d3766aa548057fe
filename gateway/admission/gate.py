"""The admission stage's façade: one synchronous ``admit`` per request, one ``release`` at its end.

How it works: ``admit`` runs, in order, the checks that refuse cheapest
first and that must not leave anything taken when a later one refuses:

1. auth -- the bearer key's record (401), then its model allow-list (403);
2. load shedding -- pool bound for the request's priority class, predicted
   wait against the deadline (503), the key's concurrency cap (429); checked
   only, nothing taken yet;
3. rate limits -- every matching rule on requests and on tokens (prompt +
   max output, reserved), all-or-nothing (429 with ``x-ratelimit-*``);
4. only then the shedding slot is taken and a :class:`Grant` returned.

``release`` settles the token reservation by the tokens actually used and
frees the slot; a grant released twice is a bug in the caller and raises.
Nothing here awaits or starts a task: with Redis-shared limits the limiters
spend local leases and a separate refresher keeps them topped up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import APIError
from .config import AdmissionSettings, parse_rule
from .keys import KeyRecord, KeyStore
from .limiter import Limiter
from .limits import (
    DEFAULT_MAX_KEYS,
    LimiterTable,
    RateLimits,
    RateRule,
    Reservation,
    Verdict,
    format_reset,
    local_limiter,
)
from .shed import DEFAULT_PRIORITY, LoadShedder

__all__ = ["Admission", "AdmissionContext", "Grant"]


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


class Grant(NamedTuple):
    """An admitted request: who (a key id, never the key), its class, and headers to send.

    Immutable like a frozen dataclass but built several times faster, which matters once per
    request. ``released`` is the one mutable cell: it makes a second ``release`` an error.
    """

    key_id: str | None
    priority: int
    headers: tuple[tuple[bytes, bytes], ...]
    reservation: Reservation | None
    pool: str
    capped_key: str | None  # the key id when its concurrency is capped
    released: list[bool]


class Admission:
    """Auth + rate limits + load shedding for the request pipeline; sans-I/O, ``now`` passed in."""

    __slots__ = ("keys", "auth_required", "limits", "shedder", "default_priority", "key_max_concurrency",
                 "_key_tables", "_max_keys", "_make", "_outstanding")

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
        self._max_keys = max_keys
        self._make = make
        self._outstanding = 0

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
        rec: KeyRecord | None = None
        if self.auth_required:
            assert self.keys is not None
            self.keys.maybe_reload(now)
            rec = self.keys.authenticate(ctx.authorization)
            if not rec.allows(ctx.model):
                raise APIError(403, f"This API key ({rec.id}) is not allowed to use the model '{ctx.model}'.",
                               "invalid_request_error", "model", "model_not_allowed")
        priority = self.default_priority if rec is None else rec.priority
        if ctx.priority is not None and ctx.priority < priority:
            priority = ctx.priority
        key_id = None if rec is None else rec.id
        cap = self.key_max_concurrency if rec is None or rec.max_concurrency == 0 else rec.max_concurrency
        self.shedder.check(ctx.model, key_id, cap, priority, ctx.deadline)
        extra = () if rec is None or not rec.limits else tuple(
            (r, self._key_table(r), rec.id) for r in rec.limits)
        values = {"key": key_id, "client": ctx.client, "model": ctx.model, "route": ctx.route}
        verdict = self.limits.check(values, float(ctx.prompt_tokens + ctx.max_tokens), now, extra)
        headers = _headers(verdict)
        if verdict.wait > 0.0:
            raise _refusal(verdict, headers)
        capped = key_id if cap > 0 else None
        self.shedder.enter(ctx.model, capped, now)  # checked above; nothing ran since
        self._outstanding += 1
        return Grant(key_id, priority, headers, verdict.reservation, ctx.model, capped, [False])

    def release(self, grant: Grant, used_tokens: int, now: float) -> None:
        """At the request's end, exactly once: settle tokens by actual use, free the slot."""
        if grant.released[0]:
            raise RuntimeError("admission grant released twice")
        grant.released[0] = True
        self._outstanding -= 1
        RateLimits.settle(grant.reservation, float(used_tokens), now)
        self.shedder.leave(grant.pool, grant.capped_key, now)

    def reload_keys(self) -> list[str]:
        """Re-read the key file now (SIGHUP); the problems, if any, with the old keys kept."""
        return [] if self.keys is None else self.keys.reload()

    def outstanding(self) -> int:
        return self._outstanding

    def _key_table(self, rule: RateRule) -> LimiterTable:
        table = self._key_tables.get(rule)
        if table is None:
            table = self._key_tables[rule] = LimiterTable(lambda value: self._make(rule, value), self._max_keys)
        return table


_H_REQ = (b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests")
_H_TOK = (b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens")
_LIMITS: dict[tuple[bytes, float], tuple[bytes, bytes]] = {}  # the limit header pair, per rule limit


def _limit_pair(name: bytes, limit: float) -> tuple[bytes, bytes]:
    pair = _LIMITS.get((name, limit))
    if pair is None:
        if len(_LIMITS) > 4096:
            _LIMITS.clear()
        pair = _LIMITS[(name, limit)] = (name, b"%d" % limit)
    return pair
_RESETS: dict[int, bytes] = {}  # reset text by its resolution step: ms below a minute, s above


def _reset_text(seconds: float) -> bytes:
    step = math.ceil(seconds * 1000) if seconds < 60.0 else -math.ceil(seconds)
    text = _RESETS.get(step)
    if text is None:
        if len(_RESETS) > 8192:
            _RESETS.clear()
        text = _RESETS[step] = format_reset(seconds).encode()
    return text


def _headers(v: Verdict) -> tuple[tuple[bytes, bytes], ...]:
    req, tok = v.requests, v.tokens
    if req is None and tok is None:
        return ()
    out: tuple[tuple[bytes, bytes], ...] = ()
    if req is not None:
        out = (_limit_pair(_H_REQ[0], req[0]), (_H_REQ[1], b"%d" % req[1]), (_H_REQ[2], _reset_text(req[2])))
    if tok is not None:
        out += (_limit_pair(_H_TOK[0], tok[0]), (_H_TOK[1], b"%d" % tok[1]), (_H_TOK[2], _reset_text(tok[2])))
    return out


def _refusal(v: Verdict, headers: tuple[tuple[bytes, bytes], ...]) -> APIError:
    if math.isinf(v.wait):
        return APIError(429, f"Request too large: it needs more {v.unit} than the limit allows in a whole "
                        "window; lower max_tokens or the prompt.", v.unit, None, "rate_limit_exceeded", None,
                        headers)
    return APIError(429, f"Rate limit reached for {v.unit}; retry in {v.wait:.3g} s.", v.unit, None,
                    "rate_limit_exceeded", v.wait, headers)
