"""Per-replica health: circuit breakers, latency outlier ejection, and a retry budget; sans-I/O,
``now`` passed in.

**Breaker** (per replica; Envoy's outlier detection and SGLang's breaker as the anchors): every
request's end is an outcome for the replica that served it (a worker's failure: 500, 502, a
retryable error before the first token; not the client's 4xx nor the gateway's own deadline).
``consecutive`` failures in a row, or an error rate over ``error_rate`` among the last
``window`` outcomes (at least ``min_requests``), open it: routing skips it for ``base_ejection``
seconds times the number of times it has been opened (capped at ``max_ejection``). Then it is
half open: one probe request at a time goes there; a success closes it, a failure opens it again.

**Latency outliers**: a replica whose time to first token (an exponential average) is more than
``outlier_factor`` times the median of its pool's other replicas, over ``outlier_min_ms``, with
``min_requests`` samples, is ejected the same way. At most ``max_ejected_share`` of a pool (at
least one replica, never the last one) is ejected at once -- unless its model has a
``fallback`` to take its traffic, when the whole pool may go; a pool whose every replica is open
and that has no fallback is used whole (Envoy's panic routing: better a degraded answer than none).

**Retry budget**: a request resubmitted because a replica failed it or refused it (an internal
error, overloaded) holds a retry token until it ends; at most ``max(floor, share x active
requests)`` tokens are out at once (Envoy: 20%, minimum 3), so a failing pool cannot multiply its
own load. Requests moved off a replica that died or drains take no token: that replica does no
work, so moving them adds none, and they are always moved (within ``api.retries``). The
attempts per request are a metric.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["HealthSettings", "Breaker", "Health", "RetryBudget", "to_heal"]

log = logging.getLogger("quicserve.health")
R = TypeVar("R")  # a replica handle (a worker connection)


@dataclass(frozen=True, slots=True)
class HealthSettings:
    consecutive: int = 5
    error_rate: float = 0.5
    window: int = 20
    min_requests: int = 10
    base_ejection: float = 5.0  # seconds, times the times ejected
    max_ejection: float = 60.0
    outlier_factor: float = 3.0
    outlier_min_ms: float = 50.0
    max_ejected_share: float = 0.1
    retry_budget_share: float = 0.2
    retry_budget_floor: int = 3
    heal_error_rate: float = 0.05  # a local replica failing more than this share ...
    heal_window: float = 300.0  # ... of its requests over this many seconds ...
    heal_min_requests: int = 20  # ... (at least this many) is drained and restarted


class Breaker:
    """One replica's state: ``closed`` | ``open`` | ``half_open``.

    Per request (the hot path: closed, nothing failed in its window, succeeding) nothing but two
    counts and the latency average change -- :meth:`ModelPool.outcome` writes that case out (``clean``
    says it holds). The recent window is only a number while none of it failed (``outcomes`` since
    ``_since``, at most ``window``); the healing window is read from the cumulative counts, sampled
    by whoever asks (:meth:`long_error_rate`, once a second by the healer)."""

    __slots__ = ("name", "state", "clean", "outcomes", "failures", "_marks", "_since", "_recent", "_recent_n",
                 "_recent_failed", "_failures_in_row", "_open_until", "times_opened", "_probing", "ttft",
                 "ttft_samples", "reason")

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "closed"
        self.clean = True  # closed with no failure in the recent window: a success changes nothing else
        self.outcomes = 0  # requests ended here since the replica (re)started ...
        self.failures = 0  # ... and how many of them failed (the healing window's counts)
        self._marks: deque[tuple[float, int, int]] = deque()  # (when, outcomes, failures) as sampled
        self._since = 0  # ``outcomes`` when the recent window last started empty
        self._recent: deque[bool] = deque()  # the latest outcomes while a failure is among them ...
        self._recent_n = 0  # ... how many (no len() per request) ...
        self._recent_failed = 0  # ... and how many of them failed
        self._failures_in_row = 0
        self._open_until = -math.inf
        self.times_opened = 0
        self._probing = False  # half open: a probe is out
        self.ttft = 0.0  # seconds, exponential average
        self.ttft_samples = 0  # answers averaged into ttft (the pool reads it: every 8th is judged)
        self.reason = ""

    def long_error_rate(self, now: float, window: float) -> tuple[int, float]:
        """(outcomes, share failed) over the last ``window`` seconds, to the spacing of the calls (the
        healer's: a second): the counts now less those at the latest call at least ``window`` ago
        (none yet: since the start)."""
        marks = self._marks
        marks.append((now, self.outcomes, self.failures))
        while len(marks) > 1 and marks[1][0] <= now - window:
            marks.popleft()
        t, n0, f0 = marks[0]
        if t > now - window:
            n0 = f0 = 0
        n = self.outcomes - n0
        return n, ((self.failures - f0) / n if n else 0.0)

    def healed(self) -> None:
        """The replica was restarted: its history starts again."""
        self._marks.clear()
        self.outcomes = self.failures = self._since = 0
        self._recent.clear()
        self._recent_n = self._recent_failed = self._failures_in_row = 0
        self.clean = self.state == "closed"

    def usable(self, now: float) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and now >= self._open_until:
            self.state, self._probing = "half_open", False
            log.info("replica %s half open: one probe request", self.name)
        return self.state == "half_open" and not self._probing

    def picked(self) -> None:
        if self.state == "half_open":
            self._probing = True

    def outcome(self, failed: bool, ttft: float | None, s: HealthSettings, now: float) -> str | None:
        """Record one request's end; returns why it should be ejected now ("..."), or "closed"
        when a probe succeeded; None otherwise. (:class:`Health` decides whether to eject.)"""
        self.outcomes += 1
        if failed:
            self.failures += 1
        elif ttft is not None:
            n = self.ttft_samples = self.ttft_samples + 1
            self.ttft = ttft if n == 1 else self.ttft + 0.2 * (ttft - self.ttft)
            if self.clean:
                return None
        elif self.clean:
            return None
        self._window(failed, s.window)
        if self.state == "half_open":
            self._probing = False
            if failed:
                return f"probe failed ({self.reason})"
            self.state, self._failures_in_row, self.reason = "closed", 0, ""
            self._restart_window()
            return "closed"
        if not failed or self.state != "closed":
            return None
        if self._failures_in_row >= s.consecutive:
            return f"{self._failures_in_row} failures in a row"
        n = self._recent_n
        if n >= s.min_requests and self._recent_failed / n > s.error_rate:
            return f"{self._recent_failed} of its last {n} requests failed"
        return None

    def _window(self, failed: bool, window: int) -> None:
        """The recent outcomes (this one counted in ``outcomes`` already), kept one by one while a
        failure is among them."""
        recent = self._recent
        if not self._recent_failed:  # a count until now: the successes it stood for, then this one
            before = min(self.outcomes - 1 - self._since, window)
            recent.clear()
            recent.extend([False] * before)
            self._recent_n = before
        recent.append(failed)
        if failed:
            self._recent_failed += 1
            self._failures_in_row += 1
        else:
            self._failures_in_row = 0
        if self._recent_n < window:
            self._recent_n += 1
        elif recent.popleft():
            self._recent_failed -= 1
        if not self._recent_failed:  # back to counting: the window's outcomes since a point that says so
            recent.clear()
            self._since = self.outcomes - self._recent_n
        self.clean = self.state == "closed" and not self._recent_failed

    def _restart_window(self) -> None:
        self._recent.clear()
        self._recent_n = self._recent_failed = self._failures_in_row = 0
        self._since = self.outcomes
        self.clean = self.state == "closed"

    def trip(self, why: str, s: HealthSettings, now: float) -> str:
        self.times_opened += 1
        self.state, self.reason = "open", why
        self._open_until = now + min(s.max_ejection, s.base_ejection * self.times_opened)
        self._restart_window()
        log.warning("replica %s ejected for %.0f s: %s", self.name, self._open_until - now, why)
        return f"open: {why}"


class Health:
    """Breakers by replica (any hashable handle) and the pool-level rules: outliers, the ejection cap."""

    def __init__(self, settings: HealthSettings | None = None) -> None:
        self.s = settings or HealthSettings()
        self.breakers: dict[object, Breaker] = {}
        self.transitions = 0
        self.panics = 0  # picks that had to use open replicas: every one of a pool was open

    def breaker(self, replica: object, name: str) -> Breaker:
        b = self.breakers.get(replica)
        if b is None:
            b = self.breakers[replica] = Breaker(name)
        return b

    def forget(self, replica: object) -> None:
        self.breakers.pop(replica, None)

    def usable(self, replicas: list[R], now: float, panic: bool = True) -> list[R]:
        """The replicas routing may pick now; when none is usable, all of them (``panic``: better a
        degraded answer than none) or none (the model has a fallback to take its traffic)."""
        ok = [r for r in replicas if (b := self.breakers.get(r)) is None or b.usable(now)]
        if ok or not replicas or not panic:
            return ok
        self.panics += 1
        return replicas

    def outcome(self, replica: object, pool: Sequence[object], failed: bool, ttft: float | None, now: float,
                fallback: bool = False) -> None:
        """One request's end on ``replica`` of ``pool``; ``fallback``: the pool's model has one, so
        all of it may be ejected (its traffic has somewhere to go). (The pool calls the breaker and
        :meth:`judge` itself, the usual case inline.)"""
        b = self.breakers.get(replica)
        if b is not None:
            self.judge(b, b.outcome(failed, ttft, self.s, now), pool, now, fallback,
                       latency=not failed and ttft is not None and not b.ttft_samples & 7)

    def judge(self, b: Breaker, why: str | None, pool: Sequence[object], now: float, fallback: bool,
              latency: bool = True) -> None:
        """After ``b``'s outcome: eject it if it asked (``why``) and the pool's cap allows, or if its
        latency makes it an outlier (judged every 8th answer)."""
        if why is None:
            if not latency or len(pool) < 2:
                return
            why = self._outlier(b, pool)
            if why is None:
                return
        self.transitions += 1
        if why == "closed":
            return
        if b.state == "half_open" or fallback or self._may_eject(b, pool):
            b.trip(why, self.s, now)
        else:
            self.transitions -= 1  # the cap: its pool has its share out already; it stays in

    def _outlier(self, b: Breaker, pool: Sequence[object]) -> str | None:
        s = self.s
        if b.state != "closed" or b.ttft_samples < s.min_requests or b.ttft * 1e3 < s.outlier_min_ms:
            return None
        others = sorted(o.ttft for r in pool if (o := self.breakers.get(r)) is not None and o is not b
                        and o.ttft_samples >= s.min_requests)
        if not others:
            return None
        median = others[len(others) // 2]
        if median > 0 and b.ttft > s.outlier_factor * median:
            return f"time to first token {b.ttft * 1e3:.0f} ms, {b.ttft / median:.1f}x its pool's median"
        return None

    def _may_eject(self, b: Breaker, pool: Sequence[object]) -> bool:
        """Whether ``b`` may be ejected too: never the last replica, at most the pool's share out."""
        out = sum(1 for r in pool if (o := self.breakers.get(r)) is not None and o is not b and o.state != "closed")
        return len(pool) > 1 and out + 1 <= max(1, math.floor(self.s.max_ejected_share * len(pool)))


def to_heal(h: Health, pools: dict[str, list[R]], now: float) -> list[tuple[R, str]]:
    """Replicas to drain and restart now, and why: error rate over ``heal_window`` past
    ``heal_error_rate`` (with ``heal_min_requests``); one per pool (the caller leaves out the pools
    it is healing a replica of), never a pool's last replica."""
    s, out = h.s, []
    for replicas in pools.values():
        if len(replicas) < 2:
            continue
        for r in replicas:
            b = h.breakers.get(r)
            if b is None:
                continue
            n, rate = b.long_error_rate(now, s.heal_window)
            if n >= s.heal_min_requests and rate > s.heal_error_rate:
                out.append((r, f"{rate:.1%} of its {n} requests in {s.heal_window:g} s failed"))
                break
    return out


class RetryBudget:
    """Retries in flight bounded by a share of the requests in flight (with a floor)."""

    __slots__ = ("share", "floor", "in_flight", "refused", "retries", "requests", "failovers")

    def __init__(self, share: float = 0.2, floor: int = 3) -> None:
        self.share, self.floor = share, floor
        self.in_flight = 0
        self.refused = 0  # retries the budget did not allow
        self.requests = 0  # requests routed (each submitted once) ...
        self.retries = 0  # ... and submitted again (moved or retried)
        self.failovers = 0  # ... of those, streams resumed after their first token (mid-stream failover)

    @property
    def attempts(self) -> int:
        """Submissions to a replica, retries included."""
        return self.requests + self.retries

    def acquire(self, active: int) -> bool:
        if self.in_flight >= max(self.floor, self.share * active):
            self.refused += 1
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1
