"""The admission stage's façade: one synchronous ``admit`` per request, one ``release`` at its end.

How it works: admission is an ordered list of checks (:class:`~gateway.admission.check.Check`):
the built-in ones of :mod:`.checks` -- the API key (when auth is on), load shedding, rate limits
(when a rule or a key may have one) -- and any added with :meth:`Admission.register`.
:meth:`Admission.admit` runs them in order on one request and returns the
:class:`~gateway.admission.check.Grant` they filled in; a check that refuses raises
:class:`~gateway.errors.APIError` (401/403/429/503) and those before it are undone, so a refused
request holds nothing. :meth:`Admission.release` releases the grant through every check, last
first, once (a second release is a bug in the caller and raises).

:meth:`Admission.admit_call`, the pipeline's admit, writes the built-in checks' usual case out in
one frame (the rate limits' own usual case compiled, :mod:`.plan`); it admits whole or takes
nothing and hands the request to :meth:`Admission.admit`. While the checks are the built-in ones,
:meth:`Admission.release_completion` writes their release out too: the per-request path stays a
frame each way, as it was before the checks were a list. Nothing here awaits or starts a task:
with Redis-shared limits the limiters spend local leases and a separate refresher tops them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .check import AdmissionContext, Check, Grant
from .checks import KeyCheck, RateCheck, ShedCheck
from .config import AdmissionSettings, parse_rule
from .keys import KeyRecord, KeyStore
from .limiter import Limiter
from .limits import DEFAULT_MAX_KEYS, RateLimits, RateRule, local_limiter
from .shed import DEFAULT_PRIORITY, LoadShedder

if TYPE_CHECKING:
    from ..api.params import GenerationRequest
    from ..http.types import Request

__all__ = ["Admission", "AdmissionContext", "Grant", "PRIORITY_OF_TIER"]

# OpenAI's service_tier as a priority hint (it may lower a key's class, never raise it)
PRIORITY_OF_TIER = {"flex": 0, "default": 1, "auto": 1, "priority": 2}


class Admission:
    """Auth + load shedding + rate limits (+ registered checks) for the request pipeline; sans-I/O,
    ``now`` passed in."""

    __slots__ = ("keys", "auth_required", "limits", "shedder", "default_priority", "key_max_concurrency", "checks",
                 "_builtin", "_usual", "_rates", "_plain_bound")

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
        checks: list[Check] = [KeyCheck(keys)] if keys is not None and auth_required else []
        checks.append(ShedCheck(shedder, key_max_concurrency))
        # rate limits where there are rules, or keys (a key's record may carry rules of its own)
        rates = RateCheck(limits, make, max_keys) if limits.rules or auth_required else None
        if rates is not None:
            checks.append(rates)
        self.checks: tuple[Check, ...] = tuple(checks)  # in the order they run; register() adds
        self._builtin = True  # the built-in checks only: release_completion writes their release out
        # admit_call writes out the built-in checks' usual case: without key caps, and none registered
        self._usual = not key_max_concurrency
        self._rates = rates if limits.rules else None  # admit_call's, when it has rules to apply
        # admit_call's plain case: a pool holding fewer than the lowest class's bound admits any class
        self._plain_bound = shedder.bound(0)

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

    def register(self, check: Check, *, before: str | None = None) -> None:
        """Add ``check`` to the list: last, or just before the check named ``before`` (a cheap refusal
        belongs early: what the checks before it took is undone when it refuses). From then on
        every request is decided by :meth:`admit` (the fast path knows the built-in checks only)."""
        names = [c.name for c in self.checks]
        if check.name in names:
            raise ValueError(f"an admission check named {check.name!r} is registered already")
        if before is not None and before not in names:
            raise ValueError(f"no admission check named {before!r} (checks: {', '.join(names)})")
        at = len(names) if before is None else names.index(before)
        self.checks = (*self.checks[:at], check, *self.checks[at:])
        self._builtin = self._usual = False

    def admit(self, ctx: AdmissionContext, now: float) -> Grant:
        """A :class:`Grant` from every check in order, or :class:`APIError` (401, 403, 429, 503) with
        nothing held: the checks that admitted before the one that refused are undone, last first."""
        grant = Grant(None, self.default_priority, (), None, ctx.model, None, ctx.prompt_tokens)
        checks = self.checks
        done = 0
        try:
            for check in checks:
                check.admit(ctx, grant, now)
                done += 1
        except BaseException:
            for check in reversed(checks[:done]):
                check.undo(ctx, grant, now)
            raise
        return grant

    def admit_call(self, req: Request, g: GenerationRequest, now: float, deadline: float | None = None) -> Grant:
        """The pipeline's admit: :meth:`admit` for a parsed request, the built-in checks' usual case
        written out in this one frame -- a key seen before, with no cap or rules of its own, allowed
        the model; a pool below even the lowest class's bound; no deadline -- with the rate limits
        decided by their compiled plan, else by the rate check's take. It admits whole, refuses (429)
        holding nothing, or takes nothing and hands the request to :meth:`admit`
        (tests/gateway/admission/test_admit_call.py drives both with the same random requests and
        asserts the same answers and state). ``deadline``: seconds the request may still take
        (gRPC's ``grpc-timeout``), None for none of its own."""
        model = g.model
        prompt = g.prompt_tokens
        if prompt < 0:
            prompt = g.prompt_estimate()
        tier = g.service_tier
        hint = None if tier is None else PRIORITY_OF_TIER.get(tier)
        authorization: bytes | None = None
        rec: KeyRecord | None = None
        key_id: str | None = None
        priority = self.default_priority
        plain = self._usual and deadline is None
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
        client = req.client
        address = None if client is None else client[0]
        st = self.shedder.pools.get(model)
        if plain and st is not None and st.outstanding < self._plain_bound:  # the shedder admits: take() plain
            rates = self._rates
            if rates is None:
                grant = Grant(key_id, priority, (), None, model, None, prompt, rec)
            else:
                tokens = prompt + g.params.max_tokens
                fast = self.limits.fast(key_id, address, model, req.path, tokens, now)  # the usual case, compiled
                if fast is None:  # not it (nothing taken): the rate check decides -- or refuses, nothing held
                    fast = rates.take((key_id, address, model, req.path), tokens, now)
                grant = Grant(key_id, priority, fast[0], fast[1], model, None, prompt, rec)
            # the shedder's slot last (it cannot refuse): LoadShedder.enter_plain, written out
            if st.outstanding == 0:
                st.estimator.busy_since = now
            st.outstanding += 1
            return grant
        return self.admit(AdmissionContext(authorization, address, model, req.path, prompt, g.params.max_tokens,
                                           deadline, hint, req.headers), now)

    def release(self, grant: object, used_tokens: int, now: float) -> None:
        """At the request's end, exactly once: settle tokens by actual use, free the slot (``grant``:
        what :meth:`admit` returned; typed ``object`` so the pipeline can call this directly)."""
        if type(grant) is not Grant:
            raise TypeError(f"not an admission grant: {grant!r}")
        self.release_completion(grant, used_tokens - grant.prompt, now)

    def release_completion(self, grant: object, completion_tokens: int, now: float) -> None:
        """:meth:`release` told only the completion tokens (the pipeline's call): the use settled
        is the reserved prompt estimate plus them. With the built-in checks only, their release is
        written out here (a call per check per request saved; test_admit_call.py compares it with
        the checks' own)."""
        if type(grant) is not Grant:
            raise TypeError(f"not an admission grant: {grant!r}")
        if grant.released:
            raise RuntimeError("admission grant released twice")
        grant.released = True
        if not self._builtin:  # every check releases, last first
            for check in reversed(self.checks):
                check.release(grant, completion_tokens, now)
            return
        res = grant.reservation  # the built-in checks' release written out: RateCheck's, then ShedCheck's
        if res is not None:
            self.limits.settle(res, grant.prompt + completion_tokens, now)
        self.shedder.leave(grant.pool, grant.capped_key, now)

    def reload_keys(self) -> list[str]:
        """Re-read the key file now (SIGHUP); the problems, if any, with the old keys kept."""
        return [] if self.keys is None else self.keys.reload()

    def outstanding(self) -> int:
        """Requests admitted and not yet released (each holds a slot in its pool)."""
        return sum(st.outstanding for st in self.shedder.pools.values())
