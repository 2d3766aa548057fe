"""Sliding-window rate limiter whose count never underestimates the true window.

What "limit" means here: at most ``limit`` units are admitted in *any* interval
``(t - window, t]``, for every ``t`` -- the definition a client can check from
its own log, and the one the accuracy tests assert. A fixed-window counter
breaks it (2x at a window edge); the usual sliding-window *estimate*
(``current + previous * overlap``) breaks it too, because it assumes the
previous window's admissions were spread evenly: a burst at the end of the old
window is under-counted and over-admitted by up to ``limit / slices``.

How it works: the window is cut into ``slices`` equal slices. Each slice keeps
the units admitted in it and the time of its latest admission. The count at
``now`` is the sum over the slices that may still hold an admission inside
``(now - window, now]``: every slice newer than the oldest one overlapping the
window, and that oldest one while its latest admission is still inside. A
slice is therefore dropped whole, at the moment its *last* admission leaves
the window; until then it is counted whole. So the count is never below the
true number admitted in the window (conservative: the limit is never
exceeded, not even by one), and it is above it only by admissions that
share a slice with a later, still-live one.

Seen another way it is a sliding log whose entries are merged per slice, the
merged entry taking its latest time: exact when every slice holds one
admission, and never more than ``slices + 1`` entries (kept only for slices
that hold admissions, so memory follows activity).

Why it still reaches the limit under overload: capacity comes back when a
slice expires and waiting traffic takes it at once, in the current slice, so
each window's admissions recycle one window later. What is lost is the time
units wait for a later admission in their slice -- under half a slice on
average -- plus the gap to the next arrival. Measured with a fake clock
(tests/gateway/admission/test_window.py) at limit 100 and 1000: 100 slices
admit 99.5-100% of the limit at 1.05x-10x overload; 50 slices 98.7-100%; ten
slices (the write-up's ten 100 ms slices of a 1 s window) only 91-95%,
the "throttles below the configured rate" failure. Hence the default of 100;
the cost per decision does not depend on it (amortised O(1): a running total,
expiry from the old end).
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["SlidingWindowLimiter", "DEFAULT_SLICES"]

DEFAULT_SLICES = 100


def _slice_end(k: int, width: float) -> float:
    """The first time in a slice after slice ``k`` (``t // width > k``), exact whatever the rounding
    of ``(k + 1) * width``: ``t // width`` is what keys the slices."""
    t = (k + 1) * width
    while t // width <= k:
        t = math.nextafter(t, math.inf)
    while (before := math.nextafter(t, -math.inf)) // width > k:
        t = before
    return t


class SlidingWindowLimiter:
    """At most ``limit`` units in any ``window`` seconds; sans-I/O, ``now`` passed in.

    Layout: the newest slice holding admissions lives in three plain slots (key, count, latest
    admission), the older ones in three deques, oldest first. Nearly every decision lands in the
    newest slice, so the hot path touches this one object and no deque.
    """

    __slots__ = ("limit", "window", "slices", "_width", "_k", "_count", "_last", "_hk", "_hc", "_hl", "_total",
                 "_horizon", "_until")

    def __init__(self, limit: float, window: float, slices: int = DEFAULT_SLICES) -> None:
        if not limit > 0:
            raise ValueError(f"limit must be > 0, got {limit!r}")
        if not (window > 0 and math.isfinite(window)):
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        if slices < 1:
            raise ValueError(f"slices must be >= 1, got {slices!r}")
        self.limit = float(limit)
        self.window = float(window)
        self.slices = slices
        self._width = self.window / slices
        # Only slices that hold admissions: memory follows activity, not ``slices``.
        self._hk: int | None = None  # the newest one (None: no slice holds anything)
        self._hc = 0.0
        self._hl = -math.inf
        self._k: deque[int] = deque()  # the older ones, oldest first
        self._count: deque[float] = deque()
        self._last: deque[float] = deque()
        self._total = 0.0
        self._horizon = math.inf  # no expiry can happen before this time (the oldest slice's earliest end)
        # The fast path's bound: before it, a ``now`` at or after the latest admission (``_hl``) is
        # in the newest slice and expires nothing (min of the horizon and the slice's end; -inf: none).
        self._until = -math.inf

    def _expire(self, now: float) -> None:
        """Drop, oldest first, the slices none of whose admissions is in (now - window, now]."""
        oldest_k = int(now // self._width) - self.slices
        start = now - self.window
        ks, counts, lasts = self._k, self._count, self._last
        while ks and (ks[0] < oldest_k or lasts[0] <= start):
            ks.popleft()
            lasts.popleft()
            self._total -= counts.popleft()
        if ks:
            self._horizon = min(lasts[0] + self.window, (ks[0] + self.slices + 1) * self._width)
            assert self._hk is not None  # older slices exist only behind a newest one
            self._bound_fast_path(self._hk)
            return
        hk = self._hk
        if hk is not None and (hk < oldest_k or self._hl <= start):
            self._hk, self._hc, self._hl = None, 0.0, -math.inf
            hk = None
        if hk is None:
            self._total = 0.0  # no float residue once empty
            self._horizon = math.inf
            self._until = -math.inf
        else:
            self._horizon = min(self._hl + self.window, (hk + self.slices + 1) * self._width)
            self._bound_fast_path(hk)

    def _bound_fast_path(self, newest: int) -> None:
        """``_until`` after the horizon or the newest slice changed."""
        self._until = min(self._horizon, _slice_end(newest, self._width))

    def used(self, now: float) -> float:
        """Units counted against the window at ``now`` (never below the true number)."""
        self._expire(now)
        return self._total

    def remaining(self, now: float) -> float:
        return max(0.0, self.limit - self.used(now))

    def wait(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units fit (0.0: now; ``inf``: never, cost exceeds the limit)."""
        if cost > self.limit:
            return math.inf
        if now >= self._horizon:
            self._expire(now)
        free = self.limit - self._total
        if cost <= free:
            return 0.0
        for count, last in zip(self._count, self._last, strict=True):  # each slice returns whole, oldest first
            free += count
            if cost <= free:
                return max(last + self.window - now, 0.0) or math.ulp(now)
        if self._hk is not None and cost <= free + self._hc:
            return max(self._hl + self.window - now, 0.0) or math.ulp(now)
        return self.window  # unreachable while counts are non-negative; a safe upper bound

    def take(self, cost: float, now: float) -> tuple[float, float]:
        """Record ``cost`` units admitted at ``now`` (the caller checked :meth:`wait` at this ``now``,
        which expired the old slices); returns :meth:`status` after it."""
        k = int(now // self._width)
        hk = self._hk
        if hk == k:
            self._hc += cost
            if now > self._hl:
                self._hl = now
        else:
            if hk is None:
                self._horizon = min(now + self.window, (k + self.slices + 1) * self._width)
            else:  # a new slice: the newest one joins the older ones
                self._k.append(hk)
                self._count.append(self._hc)
                self._last.append(self._hl)
            self._hk, self._hc, self._hl = k, cost, now
            self._bound_fast_path(k)
        self._total += cost
        rem = self.limit - self._total
        return rem if rem > 0.0 else 0.0, self._hl + self.window - now

    def try_take(self, cost: float, now: float) -> tuple[float, float, float]:
        """:meth:`wait` then, if it is 0, :meth:`take`, in one call: (wait, remaining, reset_in).

        The hot path of every admission, written out (no nested call, no deque) for the usual
        case: an admission in the newest slice, at or after its latest one, with no expiry due.
        The compiled rate plans (:mod:`.plan`) write the same lines out for the windows of their rules."""
        if self._hl <= now < self._until:
            total = self._total
            if cost <= self.limit - total:
                self._hc += cost
                self._total = total = total + cost
                self._hl = now
                rem = self.limit - total
                return 0.0, rem if rem > 0.0 else 0.0, self.window
        if now >= self._horizon:
            self._expire(now)
        if cost > self.limit - self._total:
            return self.wait(cost, now), 0.0, 0.0
        rem, reset = self.take(cost, now)
        return 0.0, rem, reset

    def untake(self, cost: float, now: float) -> None:
        """Undo the :meth:`take` just made at ``now`` (another rule refused the request)."""
        if self._hk == int(now // self._width):
            self._hc -= cost
            self._total -= cost

    def refund(self, amount: float, at: float, now: float) -> None:
        """Correct the units taken at ``at`` by ``-amount`` (a reservation larger than the use).

        A negative ``amount`` charges more. Nothing to correct once that slice has expired.
        """
        if now >= self._horizon:
            self._expire(now)
        k = int(at // self._width)
        if self._hk == k:  # usually: the request ended in the slice it started in
            count = self._hc
            new = count - amount if count > amount else 0.0
            self._total += new - count
            self._hc = new
            return
        ks = self._k
        for i in range(len(ks) - 1, -1, -1):  # newest first: a request's end is usually soon after it
            if ks[i] == k:
                new = max(0.0, self._count[i] - amount)
                self._total += new - self._count[i]
                self._count[i] = new
                return
            if ks[i] < k:
                return

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._expire(now)
        return max(0.0, self._hl + self.window - now) if self._hk is not None else 0.0

    def status(self, now: float) -> tuple[float, float]:
        """(remaining, reset_in) after one expiry pass."""
        if now >= self._horizon:
            self._expire(now)
        reset = self._hl + self.window - now if self._hk is not None else 0.0
        return max(0.0, self.limit - self._total), max(0.0, reset)

    def idle(self, now: float) -> bool:
        """True when nothing is counted any more: the limiter can be dropped without loss (the
        newest slice's latest admission is the latest of all; -inf once every slice expired)."""
        return self._hl <= now - self.window

    def latest(self) -> float:
        """The time of the latest admission (-inf: none counted)."""
        return self._hl

    def __repr__(self) -> str:
        return f"SlidingWindowLimiter(limit={self.limit:g}, window={self.window:g}, slices={self.slices})"
