"""A rate limiter that spends a local lease of a shared (Redis) quota; sans-I/O.

How it works: the shared store keeps the same conservative sliding window as
:mod:`.window` (slices with their latest admission) plus the *outstanding
leases* of every gateway. A lease of ``g`` units spendable from ``s`` (the
grant's time, or later for a future lease, below) until ``s + ttl`` counts in
full from the grant until it is settled or until ``s + ttl + window``. Spending is local and
synchronous (:meth:`wait`/:meth:`take`, no I/O); the units spent are kept per
slice with their latest time, and the next renewal *settles* the lease: the
spends go into the shared slices at their real times, the rest is returned,
and a new lease is granted in the same atomic script. Token corrections at
release are sent the same way, to the slice the tokens were spent in.

Why the shared limit holds across gateways: every unit a gateway admits is
counted in the store from before it is spent (inside its lease) until at
least ``window`` after it was spent (its slice's latest time is no earlier),
so the store's count is never below the true number admitted by all
gateways in any window -- the local argument, unchanged. The exceptions are
bounded and named: a limiter's very first request (a cold key has no lease
yet) is admitted on credit and reported at once; and while the store is
unreachable with ``fail_open`` nothing is counted (the adapter counts those).

Why it still reaches the limit: when the window is full the store does not
just say "later": it grants a *future* lease, spendable from the moment the
capacity it needs leaves the window (``start``), counted from now (so no one
else is granted the same units). The gateway then admits at that moment
without a round trip, exactly as a local limiter would, and the per-slice
settlement keeps the local 100-slice accuracy; a round trip or a late loop
wake-up no longer delays each recycled burst (measured: the real-time
two-process test lost 1-2% to them before; with future leases it admits
99.75-100% of the limit, never above, also with the host's CPUs saturated).
Leases are sized to recent demand and capped at a share of the limit, so
units one gateway holds unspent come back within one renewal.

Why a client below the limit is not refused: a lease is renewed when a
quarter of it is left or its life is ending, and it goes on being spent
while the call is out -- its unspent units are *carried* into the new lease
(re-granted first: counted before the call, counted after), and what was
spent in flight is taken off the answer. Without the carry, requests that
met the lease during a round trip got a 429 at half the limit (measured: 2%). The lease life (``ttl``, 0.25 s) only bounds how
long a quiet gateway can sit on unspent units; under overload leases are
spent at once, and a short life made a starved process (a late loop) lose
its leases unspent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import APIError
from .limiter import TakeAfterWait
from .limits import RateRule

__all__ = ["LeasedLimiter", "Renewal", "Grant", "DEFAULT_TTL", "DEFAULT_LEASE_SHARE"]

DEFAULT_TTL = 0.25  # seconds a lease may be spent: how long unspent units can be held from others
DEFAULT_LEASE_SHARE = 0.1  # the most of a limit one lease takes


@dataclass(frozen=True, slots=True)
class Renewal:
    """One settle-and-lease call for the store: arguments of the script."""

    now: float
    old_lease: str  # "" when none
    new_lease: str  # "" when the limiter is going idle (settle only)
    want: float
    need: float
    deltas: tuple[tuple[int, float, float], ...]  # (slice, units, latest time or -1 for a correction)
    carry: float = 0.0  # unspent units of the old lease, still being spent while the call is out


@dataclass(frozen=True, slots=True)
class Grant:
    """The store's answer: units granted and from when (or when to retry if none), units counted."""

    granted: float
    start: float
    used: float
    reset_at: float


class LeasedLimiter(TakeAfterWait):
    """One (rule, scope value): spends its lease, asks for renewals, settles spends by slice."""

    __slots__ = ("rule", "limit", "key", "ttl", "cap", "fail_open", "_ids", "_on_hungry",
                 "lease", "units", "since", "until", "_spent", "_corrections", "_cold", "hungry", "retry_at",
                 "_asked", "_need", "_asked_since", "_demand", "_used", "_reset_at", "down_until", "fail_open_admits",
                 "_seen", "_size", "_in_flight")

    def __init__(self, rule: RateRule, key: str, ttl: float, lease_share: float, fail_open: bool,
                 ids: Callable[[], str], on_hungry: Callable[[LeasedLimiter], None]) -> None:
        if rule.algorithm != "window":
            raise ValueError("shared limits use the sliding window (a bucket's refill has no shared clock)")
        self.rule, self.limit, self.key, self.ttl = rule, rule.limit, key, ttl
        self.cap = max(1.0, rule.limit * lease_share)
        self.fail_open = fail_open
        self._ids, self._on_hungry = ids, on_hungry
        self.lease = ""  # current lease id
        self.units = 0.0  # spendable now
        self.since = -math.inf  # lease may be spent from this time (a future lease: when capacity frees)
        self.until = -math.inf  # ... and before this time
        self._spent: dict[int, list[float]] = {}  # slice -> [units, latest time], since the last settle
        self._corrections: dict[int, float] = {}  # slice -> units to give back
        self._cold = True  # no answer from the store yet: the first request goes on credit
        self.hungry = False
        self.retry_at = -math.inf  # the store said: nothing before this time
        self._asked = 0.0  # units asked since the last renewal (demand)
        self._need = math.inf  # the smallest request that found no lease: a lease below it is useless
        self._asked_since = -math.inf
        self._demand = 0.0  # units per second, EWMA over renewals
        self._used = 0.0  # store's count at the last answer (for headers)
        self._reset_at = -math.inf
        self.down_until = -math.inf  # store unreachable until then
        self.fail_open_admits = 0
        self._seen = -math.inf
        self._size = 0.0  # the current lease's size when granted (its low-water mark is a quarter)
        self._in_flight: float | None = None  # units spent since a carrying renewal was sent

    # --- the Limiter protocol (hot path, no I/O) ------------------------------------------

    def wait(self, cost: float, now: float) -> float:
        if cost > self.limit:
            return math.inf
        if self._seen == -math.inf:
            self._asked_since = now  # demand is measured from the first request
        self._seen = now
        if now < self.down_until:
            if self.fail_open:
                return 0.0
            raise APIError(503, "The shared rate-limit store is unreachable.", "server_error", None,
                           "overloaded", 1.0)
        self._asked += cost  # demand, whether the lease covers it or not: sizes the next lease
        if now < self.until and cost <= self.units:
            return 0.0 if now >= self.since else self.since - now
        self._need = min(self._need, cost)
        if self._cold:
            return 0.0
        self._want(now)
        return max(self.retry_at - now, self.ttl)

    def take(self, cost: float, now: float) -> tuple[float, float]:
        if now < self.down_until:
            self.fail_open_admits += 1
            return self.status(now)
        if self._cold:
            self._cold = False
            self._want(now)
        else:
            self.units -= cost
            if self._in_flight is not None:
                self._in_flight += cost
        k = int(now // (self.rule.window / self.rule.slices))
        cell = self._spent.get(k)
        if cell is None:
            self._spent[k] = [cost, now]
        else:
            cell[0] += cost
            cell[1] = now
        return self.status(now)

    def untake(self, cost: float, now: float) -> None:
        """Undo the take just made: the units go back to the lease, the spend is forgotten."""
        k = int(now // (self.rule.window / self.rule.slices))
        cell = self._spent.get(k)
        if cell is not None:
            cell[0] = max(0.0, cell[0] - cost)
            if now < self.until:
                self.units += cost
                if self._in_flight is not None:
                    self._in_flight -= cost

    def refund(self, amount: float, at: float, now: float) -> None:
        k = int(at // (self.rule.window / self.rule.slices))
        cell = self._spent.get(k)
        if cell is not None:  # not settled yet: correct locally
            cell[0] = max(0.0, cell[0] - amount)
        else:
            self._corrections[k] = self._corrections.get(k, 0.0) + amount

    def remaining(self, now: float) -> float:
        return max(0.0, self.limit - self._used)

    def reset_in(self, now: float) -> float:
        return max(0.0, self._reset_at - now)

    def status(self, now: float) -> tuple[float, float]:
        return self.remaining(now), self.reset_in(now)

    def latest(self) -> float:
        return self._seen

    def idle(self, now: float) -> bool:
        return not self.lease and not self._spent and not self._corrections and self._seen <= now - self.rule.window

    # --- renewals (the adapter's side) ------------------------------------------------------

    def _want(self, now: float) -> None:
        if not self.hungry:
            self.hungry = True
            self._on_hungry(self)

    def due(self, now: float, horizon: float) -> bool:
        """Needs the store before ``now + horizon``: lease ending or down to a quarter (renewed
        before it runs dry, so requests do not meet an empty lease), hungry past ``retry_at``,
        corrections to send (they free capacity), or spends to settle while holding no lease."""
        if self._in_flight is not None:
            return False  # one call at a time per limiter
        if self.hungry and now >= self.retry_at:
            return True
        if self.lease:
            low = self.units < 0.25 * self._size and self._seen > now - self.rule.window
            return self.until - now <= horizon or low or bool(self._corrections)
        return bool(self._spent or self._corrections)

    def renewal(self, now: float, horizon: float = 0.0) -> Renewal:
        """The call to send now; the spends it carries are cleared (sent once). A lease that is
        not ending keeps going: the call then only settles (spends sent early stay counted by
        the lease entry too until it is settled -- conservative)."""
        hungry = self.hungry and now >= self.retry_at
        low = self.units < 0.25 * self._size and self._seen > now - self.rule.window
        if self.lease and self.until - now > horizon and not hungry and not low:
            return Renewal(now, "", "", 0.0, 0.0, self._deltas())
        elapsed = now - self._asked_since
        if math.isfinite(elapsed) and elapsed > 0:
            rate = self._asked / elapsed
            self._demand = rate if self._demand == 0.0 else 0.5 * (self._demand + rate)
        self._asked_since = now
        need = 1.0 if math.isinf(self._need) else self._need
        self._asked, self._need = 0.0, math.inf
        active = (self.hungry and now >= self.retry_at) or (
            not self.hungry and self._seen > now - self.rule.window)
        want = min(max(self.cap, need), max(need, self._demand * self.ttl * 2.0)) if active else 0.0
        # A started lease that can still serve the smallest waiting request goes on while the call
        # is out (its unspent units are carried into the new lease); otherwise it ends here.
        live = self.lease and self.since <= now < self.until and self.units >= need
        carry = self.units if live and want > 0 else 0.0
        call = Renewal(now, self.lease, self._ids() if want > 0 else "", want, min(need, want), self._deltas(),
                       carry)
        if carry > 0:
            self._in_flight = 0.0
        else:
            self.lease, self.units, self.since, self.until = "", 0.0, -math.inf, -math.inf
        return call

    def _deltas(self) -> tuple[tuple[int, float, float], ...]:
        deltas = tuple((k, c[0], c[1]) for k, c in self._spent.items()) + tuple(
            (k, -a, -1.0) for k, a in self._corrections.items())
        self._spent.clear()
        self._corrections.clear()
        return deltas

    def granted(self, call: Renewal, grant: Grant) -> None:
        """Apply the store's answer to ``call``."""
        self._cold = False
        self._used, self._reset_at = grant.used, grant.reset_at
        spent, self._in_flight = self._in_flight or 0.0, None
        if call.carry > 0 and grant.granted <= call.carry:  # carried on, nothing more for now
            self.lease, self.units = call.new_lease, grant.granted - spent
            self.until = call.now + self.ttl
        elif grant.granted > 0:
            self.lease, self.units = call.new_lease, grant.granted - spent
            self.since, self.until = grant.start, grant.start + self.ttl
            self._size = grant.granted
            self.hungry = False
            self.retry_at = -math.inf
        elif call.new_lease:
            self.retry_at = grant.start  # stay hungry; the adapter comes back then

    def failed(self, call: Renewal, now: float, backoff: float) -> None:
        """The store did not answer: spends are lost to it (counted locally as fail-open admits)."""
        self.down_until = now + backoff
        self.hungry = False
        self._cold = False
        self._in_flight = None  # a carried lease goes on: its units are counted whichever way it went
        del call

    def retire(self, now: float) -> None:
        """Make the next renewal settle only (shutdown): no new lease, spends and leftovers sent."""
        self.hungry = False
        self._seen = -math.inf
        if self.lease:
            self.until = now

    def __repr__(self) -> str:
        return f"LeasedLimiter({self.rule.scope} {self.rule.unit} {self.limit:g}/{self.rule.window:g}s)"
