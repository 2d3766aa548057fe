"""Rate limiters that spend a local lease of a shared (Redis) quota; sans-I/O.

Two kinds, one lease scheme (:mod:`.lease_kinds`): ``LeasedWindow`` (the sliding
window of :mod:`.window`, shared) and ``LeasedBucket`` (the token bucket of
:mod:`.bucket`, shared as GCRA). What follows describes the window; the bucket
differs only in what a lease is: its units are taken from the shared bucket
when granted, and a settlement gives back what was not spent.

Clocks: a limiter's times (``now`` in every method) are the gateway's request
clock (:mod:`gateway.clock`); the store's are the Redis server's. They never
meet: a :class:`Renewal` carries *ages* (how long before the call a spend was
made), a :class:`Grant` carries *durations* (the lease may be spent in
``start_in`` seconds, the window empties in ``reset_in``), and each side turns
them into its own times. The conversion's only error is the network delay,
and it falls on the safe side: a spend reaches the store a little later than
it was made, so it is counted a little longer; a lease becomes spendable when
its answer arrives, a little after the store granted it.

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
bounded and named: a cold limiter (a key seen for the first time) admits on
credit until the store's first answer, one round trip, and reports those
spends with its next call; and while the store is unreachable with
``fail_open`` nothing is counted (the adapter counts those).

Why it still reaches the limit: when the window is full the store does not
just say "later": it grants a *future* lease, spendable from the moment the
capacity it needs leaves the window (``start``), counted from then (a grant
must fit under the limit at every time from its start to its end, so no one
else is granted the same units). The gateway then admits at that moment
without a round trip, exactly as a local limiter would, and the per-slice
settlement keeps the local 100-slice accuracy; a round trip or a late loop
wake-up no longer delays each recycled burst (measured: the real-time
two-process test lost 1-2% to them before; with future leases it admits
99.75-100% of the limit, never above, also with the host's CPUs saturated).
Leases are sized to recent demand and capped at a share of the limit, so
units one gateway holds unspent come back within one renewal.

Why units a slow gateway held are not lost: a renewal carries on at most what
recent demand asks (a process starved of CPU, slow to spend, gives the rest
back), a future lease counts only from its start (units given back before it
are free to others meanwhile), and a gateway holding one asks again when the
leases counted now end (the store's ``recheck_in``), so it spends what came
back now rather than a window later. (Measured: without the three, the
three-process test admitted 163-187 of 200 in 3 of 6 runs with the host's two
CPUs saturated by 8 busy loops; with them, 200 in 17 of 17.)

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

__all__ = ["LeasedLimiter", "Renewal", "Grant", "DEFAULT_TTL", "DEFAULT_LEASE_SHARE", "MIN_LEASE"]

DEFAULT_TTL = 0.25  # seconds a lease may be spent: how long unspent units can be held from others
DEFAULT_LEASE_SHARE = 0.1  # the most of a limit one lease takes
MIN_LEASE = 4.0  # ... unless that is fewer units than this


@dataclass(frozen=True, slots=True)
class Renewal:
    """One settle-and-lease call for the store. ``now`` is the limiter's clock and stays here;
    everything the store reads is a count or an age (seconds before the call)."""

    now: float
    old_lease: str  # "" when none
    new_lease: str  # "" when the limiter is going idle (settle only)
    want: float  # units asked beyond the carry
    need: float
    deltas: tuple[tuple[float, float, bool], ...] = ()  # window: (age, units, spend?) -- a spend's latest
    # time, or a correction to the slice of a spend settled before (negative units)
    carry: float = 0.0  # unspent units of the old lease, still being spent while the call is out
    returned: float = 0.0  # bucket: unspent units of a lease that ends here, given back
    debit: float = 0.0  # bucket: units spent on credit, less refunds (negative: give back)


@dataclass(frozen=True, slots=True)
class Grant:
    """The store's answer, in durations from when it ran: units granted and in how long they may be
    spent (or when to retry if none), units counted, how long until the count is empty."""

    granted: float
    start_in: float
    used: float
    reset_in: float
    recheck_in: float = math.inf  # a window's future lease (or none): when another gateway's lease now
    # counted ends, and may give units back (then asking again can bring the start forward)


class LeasedLimiter(TakeAfterWait):
    """One (rule, scope value): spends its lease, asks for renewals; what a spend leaves to settle
    is the subclass's (per slice for a window, a debit for a bucket)."""

    kind = ""  # the script that serves it: "window" | "bucket"

    __slots__ = ("rule", "limit", "capacity", "_reset_cap", "key", "ttl", "cap", "fail_open", "_ids", "_on_hungry",
                 "lease", "units", "since", "until", "_cold", "hungry", "retry_at",
                 "_asked", "_need", "_asked_since", "_demand", "_used", "_reset_at", "failing", "down_until", "fail_open_admits",
                 "_seen", "_size", "_in_flight", "recheck_at")

    def __init__(self, rule: RateRule, key: str, ttl: float, lease_share: float, fail_open: bool,
                 ids: Callable[[], str], on_hungry: Callable[[LeasedLimiter], None]) -> None:
        if rule.algorithm != self.kind:
            raise ValueError(f"{type(self).__name__} serves {self.kind} rules, not {rule.algorithm}")
        self.rule, self.limit, self.key, self.ttl = rule, rule.limit, key, ttl
        self.capacity = (rule.burst or rule.limit) if rule.algorithm == "bucket" else rule.limit  # most at once
        # a lease of a few units at least, so a small limit's client does not meet an empty lease
        # between two round trips (ttl still bounds how long they are held from other gateways)
        self.cap = max(min(MIN_LEASE, self.capacity), self.capacity * lease_share)
        self._reset_cap = rule.window * self.capacity / rule.limit
        self.fail_open = fail_open
        self._ids, self._on_hungry = ids, on_hungry
        self.lease = ""  # current lease id
        self.units = 0.0  # spendable now
        self.since = -math.inf  # lease may be spent from this time (a future lease: when capacity frees)
        self.until = -math.inf  # ... and before this time
        self._cold = True  # no answer from the store yet: requests go on credit until the first one
        self.hungry = False
        self.retry_at = -math.inf  # the store said: nothing before this time
        self._asked = 0.0  # units asked since the last renewal (demand)
        self._need = math.inf  # the smallest request that found no lease: a lease below it is useless
        self._asked_since = -math.inf
        self._demand = 0.0  # units per second, EWMA over renewals
        self._used = 0.0  # store's count at the last answer (for headers)
        self._reset_at = -math.inf
        self.failing = False  # the store's last answer was an error (until one succeeds)
        self.down_until = -math.inf  # ... and it is not asked again before this time
        self.fail_open_admits = 0
        self._seen = -math.inf
        self._size = 0.0  # the current lease's size when granted (its low-water mark is a quarter)
        self._in_flight: float | None = None  # units spent since a carrying renewal was sent
        self.recheck_at = math.inf  # holding a future lease: ask again from then (:attr:`Grant.recheck_in`)

    # --- the Limiter protocol (hot path, no I/O) ------------------------------------------

    def wait(self, cost: float, now: float) -> float:
        if cost > self.capacity:
            return math.inf
        if self._seen == -math.inf:
            self._asked_since = now  # demand is measured from the first request
        self._seen = now
        self._asked += cost  # demand, whether the lease covers it or not: sizes the next lease
        if now < self.until and cost <= self.units:
            if now >= self.since:
                return 0.0
            if now >= self.recheck_at:  # units another gateway held may be free before the start
                self.recheck_at = math.inf
                self._want(now)
            return self.since - now
        if self.failing:  # the store's last answer was an error, and no lease covers this
            if now >= self.down_until:
                self._want(now)  # the backoff has passed: try the store again
            if self.fail_open:
                return 0.0
            raise APIError(503, "The shared rate-limit store is unreachable.", "server_error", None,
                           "overloaded", 1.0)
        self._need = min(self._need, cost)
        if self._cold:
            return 0.0
        self._want(now)
        return max(self.retry_at - now, self.ttl)

    def take(self, cost: float, now: float) -> tuple[float, float]:
        if self.failing and not (self.since <= now < self.until and cost <= self.units):
            self.fail_open_admits += 1  # admitted uncounted: the store is unreachable (fail open)
            return self.status(now)
        if self._cold:  # no answer from the store yet: on credit, reported with the next renewal
            self._want(now)
            self._spend(cost, now, True)
        else:
            units = self.units = self.units - cost
            if self._in_flight is not None:
                self._in_flight += cost
            elif units <= 0.25 * self._size:
                self._on_hungry(self)  # down to its low-water mark: renew now, not at the next tick
            self._spend(cost, now, False)
        return self.status(now)

    def remaining(self, now: float) -> float:
        """Units left: the store's count at the last answer, less what this gateway's own lease
        still holds unspent (they are counted there, and still free for this gateway's clients)."""
        own = self.units if self.lease and now < self.until else 0.0
        return max(0.0, self.capacity - self._used + own)

    def reset_in(self, now: float) -> float:
        """Until the count is empty: the store's answer, at most the longest a unit admitted now can
        count (a window; a bucket's time to refill from empty) -- the store's figure also covers lease
        entries, which are settled well before their expiry."""
        return min(max(0.0, self._reset_at - now), self._reset_cap)

    def status(self, now: float) -> tuple[float, float]:
        return self.remaining(now), self.reset_in(now)

    def latest(self) -> float:
        return self._seen

    def idle(self, now: float) -> bool:
        return not self.lease and not self._unsettled() and self._seen <= now - self.rule.window

    # --- what a spend leaves to settle (the kind's) -------------------------------------------

    def untake(self, cost: float, now: float) -> None:
        """Undo the take just made (another rule refused the request)."""
        raise NotImplementedError

    def refund(self, amount: float, at: float, now: float) -> None:
        """Give back ``amount`` of what was taken at ``at`` (negative: charge more)."""
        raise NotImplementedError

    def _spend(self, cost: float, now: float, credit: bool) -> None:
        """Record ``cost`` admitted at ``now``, from the lease or (``credit``) without one."""
        raise NotImplementedError

    def _unsettled(self) -> bool:
        """Anything to send the store, lease or not."""
        raise NotImplementedError

    def _urgent(self) -> bool:
        """Something that frees shared capacity (a refund): send it even while a lease goes on."""
        raise NotImplementedError

    def _settle(self, renewal: Renewal, dropped: float) -> Renewal:
        """``renewal`` with what there is to settle (then forgotten here: sent once); ``dropped``:
        unspent units of a lease that ends with this call."""
        raise NotImplementedError

    # --- renewals (the adapter's side) ------------------------------------------------------

    def _want(self, now: float) -> None:
        if not self.hungry:
            self.hungry = True
            self._on_hungry(self)

    def due(self, now: float, horizon: float) -> bool:
        """Needs the store before ``now + horizon``: lease ending or down to a quarter (renewed
        before it runs dry, so requests do not meet an empty lease), hungry past ``retry_at``,
        refunds to send (they free capacity), or spends to settle while holding no lease."""
        if self._in_flight is not None:
            return False  # one call at a time per limiter
        if self.hungry and now >= self.retry_at:
            return True
        if self.lease:
            low = self.units <= 0.25 * self._size and self._seen > now - self.rule.window
            return self.until - now <= horizon or low or self._urgent()
        return self._unsettled()

    def renewal(self, now: float, horizon: float = 0.0) -> Renewal:
        """The call to send now. A lease that is not ending keeps going: the call then only settles
        (for a window, spends sent early stay counted by the lease entry too until it is settled --
        conservative)."""
        hungry = self.hungry and now >= self.retry_at
        low = self.units <= 0.25 * self._size and self._seen > now - self.rule.window
        if self.lease and self.until - now > horizon and not hungry and not low:
            return self._settle(Renewal(now, "", "", 0.0, 0.0), 0.0)
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
        # is out (its unspent units are carried into the new lease, up to the size recent demand
        # asks: a slow or starved gateway gives the rest back rather than sit on units other
        # gateways' clients are refused for); otherwise it ends here.
        live = self.lease and self.since <= now < self.until and self.units >= need
        carry = min(self.units, want) if live and want > 0 else 0.0
        old, dropped = self.lease, 0.0
        if carry > 0:
            dropped, self.units = self.units - carry, carry
            self._in_flight = 0.0
        else:
            dropped = max(0.0, self.units) if self.lease else 0.0
            self.lease, self.units, self.since, self.until = "", 0.0, -math.inf, -math.inf
        call = Renewal(now, old, self._ids() if want > 0 else "", want - carry, min(need, want), carry=carry)
        return self._settle(call, dropped)

    def granted(self, call: Renewal, grant: Grant, now: float) -> None:
        """Apply the store's answer to ``call``; ``now``: when it arrived (the grant's durations
        count from then: a little after the store ran, which is the safe side)."""
        self._cold = self.failing = False
        self._used, self._reset_at = grant.used, now + grant.reset_in
        spent, self._in_flight = self._in_flight or 0.0, None
        if call.carry > 0 and grant.granted <= call.carry:  # carried on, nothing more for now
            self.lease, self.units = call.new_lease, grant.granted - spent
            self.until = call.now + self.ttl
            self._size = grant.granted  # its low-water mark: a quarter of what it carries now
        elif grant.granted > 0:
            self.lease, self.units = call.new_lease, grant.granted - spent
            self.since = now + grant.start_in
            self.until = self.since + self.ttl
            self.recheck_at = now + grant.recheck_in if grant.start_in > 0 else math.inf
            self._size = grant.granted
            self.hungry = False
            self.retry_at = -math.inf
        elif call.new_lease:  # stay hungry; the adapter comes back then
            self.retry_at = now + min(grant.start_in, grant.recheck_in)

    def failed(self, call: Renewal, now: float, backoff: float) -> None:
        """The store did not answer: spends are lost to it. Until it answers again, a lease still
        held is spent; beyond it requests are admitted uncounted (``fail_open``, counted here as
        fail-open admits) or refused with 503, and after ``backoff`` the next request asks again."""
        self.failing = True
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
        return f"{type(self).__name__}({self.rule.scope} {self.rule.unit} {self.limit:g}/{self.rule.window:g}s)"
