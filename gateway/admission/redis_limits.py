"""Rate limits shared by every gateway through Redis: leases renewed in batches, not per request.

How it works: :meth:`RedisLeases.make` is the limiter factory handed to
:class:`~gateway.admission.gate.Admission`; each limiter it makes is a
:class:`~.lease.LeasedLimiter` that decides locally (no round trip on the
request path). :meth:`RedisLeases.run` is the asyncio adapter: it wakes when
a limiter is hungry or a lease is about to end, collects every due renewal
and sends them in one pipeline of ``EVALSHA`` calls -- one round trip per
loop wake-up for all keys, whatever the request rate. The script
(:data:`SCRIPT`) settles the old lease, applies spends and corrections to the
shared slices, expires what left the window, and grants a new lease if the
window has room, atomically per key (:mod:`.redis_scripts`: a sliding
window, or a token bucket as GCRA). The accuracy argument is in :mod:`.lease`.

Clocks: the store's times are the Redis server's (``TIME`` in the scripts);
the limiters' are the gateway's request clock (:func:`gateway.clock.now`), which
this loop must share with the request path -- it is the default, and nothing
else should be passed outside tests. Only ages and durations are exchanged,
so gateways need no synchronised clocks: a gateway whose clock is off by
seconds limits exactly as one that is not (tested with two real gateways 4 s
apart).

Redis unreachable: ``fail_open`` admits and counts it (``fail_open_admits``,
``errors``), otherwise the limiters answer 503 until ``backoff`` has passed;
then the next renewal tries again. Redis restarted empty: the scripts are
loaded again (``NOSCRIPT``) in the same step, and the limits start from an
empty store (what was counted before the restart is lost with it).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import os
from collections.abc import Callable
from typing import Any

from redis.exceptions import NoScriptError

from .. import clock as _clock
from .config import AdmissionSettings
from .lease import DEFAULT_LEASE_SHARE, DEFAULT_TTL, Grant, LeasedLimiter, Renewal
from .lease_kinds import LEASED
from .limiter import Limiter
from .limits import RateRule
from .redis_scripts import ARGS, SCRIPTS

__all__ = ["RedisLeases"]


def _rule_id(rule: RateRule) -> str:
    return hashlib.sha256(repr(rule).encode()).hexdigest()[:12]


class RedisLeases:
    """Limiter factory + renewal loop for limits shared in Redis (``redis.asyncio`` client).

    ``clock``: the limiters' clock, the request path's (:func:`gateway.clock.now`). ``store_clock``:
    for tests only, a fixed "now" for the scripts in place of the Redis server's ``TIME``.
    """

    def __init__(self, client: Any, *, prefix: str = "quicserve:rl:", ttl: float = DEFAULT_TTL,
                 tick: float = 0.005, lease_share: float = DEFAULT_LEASE_SHARE, fail_open: bool = True,
                 backoff: float = 1.0, clock: Callable[[], float] = _clock.now,
                 store_clock: Callable[[], float] | None = None) -> None:
        self.client = client
        self.prefix, self.ttl, self.tick, self.lease_share = prefix, ttl, tick, lease_share
        self.fail_open, self.backoff, self.clock = fail_open, backoff, clock
        self.store_clock = store_clock
        self._instance = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._seq = itertools.count()
        self._limiters: set[LeasedLimiter] = set()
        self._wake = asyncio.Event()
        self._sha: dict[str, str] = {}  # kind -> the loaded script's SHA1
        self.round_trips = 0
        self.errors = 0  # renewal rounds the store did not answer
        self.reloads = 0  # scripts loaded again after NOSCRIPT (a store restarted empty)
        self._fail_open_forgotten = 0  # fail-open admits of limiters dropped as idle

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> RedisLeases:
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: a failed renewal is retried by the loop, and fail-open/closed
        # must take effect within one ``backoff``, not after the client's own retry schedule.
        client = redis.asyncio.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0,
                                              retry=Retry(NoBackoff(), 0))
        return cls(client, **kw)

    @classmethod
    def from_settings(cls, s: AdmissionSettings) -> RedisLeases:
        """From ``[admission]``: ``redis_url``, ``redis_lease_ttl``, ``redis_lease_share``, ``redis_fail``."""
        return cls.from_url(s.redis_url, ttl=s.redis_lease_ttl, lease_share=s.redis_lease_share,
                            fail_open=s.redis_fail == "open")

    @property
    def fail_open_admits(self) -> int:
        """Requests admitted uncounted while the store was unreachable (``fail_open``)."""
        return self._fail_open_forgotten + sum(lim.fail_open_admits for lim in self._limiters)

    def limiters(self) -> int:
        """Leased limiters held (bounded by the rule tables, plus idle ones until their last settle)."""
        return len(self._limiters)

    def make(self, rule: RateRule, value: str) -> Limiter:
        """The factory for :class:`RateLimits`/:class:`Admission`: one leased limiter per scope value,
        a sliding window or a token bucket as the rule says."""
        key = f"{self.prefix}{rule.algorithm[0]}:{_rule_id(rule)}:{value}"
        lim = LEASED[rule.algorithm](rule, key, self.ttl, self.lease_share, self.fail_open, self._next_id,
                                     self._hungry)
        self._limiters.add(lim)
        return lim

    def _next_id(self) -> str:
        return f"{self._instance}-{next(self._seq)}"

    def _hungry(self, lim: LeasedLimiter) -> None:
        self._limiters.add(lim)  # it may have been dropped as idle while a table still held it
        self._wake.set()

    async def step(self, now: float) -> int:
        """Send every renewal due by ``now`` in one pipeline; returns how many were sent."""
        due = [lim for lim in self._limiters if lim.due(now, self.tick * 2)]
        idle = [lim for lim in self._limiters if lim.idle(now) and lim not in due]
        for lim in idle:  # evicted from the tables or quiet for a window: forget
            if lim.hungry is False:
                self._limiters.discard(lim)
                self._fail_open_forgotten += lim.fail_open_admits
                lim.fail_open_admits = 0
        if not due:
            return 0
        calls = [lim.renewal(now, self.tick * 2) for lim in due]
        store_now = "" if self.store_clock is None else repr(self.store_clock())
        try:
            try:
                replies = await self._send(due, calls, store_now)
            except NoScriptError:
                # The store lost its scripts (restarted, or SCRIPT FLUSH): no call ran, so send
                # them again once the scripts are back. (redis-py's message for it does not say
                # "NOSCRIPT": matching the text, as this once did, never reloaded them.)
                self._sha.clear()
                self.reloads += 1
                replies = await self._send(due, calls, store_now)
        except Exception:  # any failure of the store: fall back as configured
            self.errors += 1
            for lim, call in zip(due, calls, strict=True):
                lim.failed(call, now, self.backoff)
            return len(calls)
        self.round_trips += 1
        arrived = self.clock()
        for lim, call, reply in zip(due, calls, replies, strict=True):
            g, start_in, used, reset_in, *more = (float(x) for x in reply)
            recheck_in = more[0] if more and more[0] >= 0 else math.inf  # a bucket: none
            lim.granted(call, Grant(g, start_in, used, reset_in, recheck_in), arrived)
        return len(calls)

    async def _send(self, due: list[LeasedLimiter], calls: list[Renewal], store_now: str) -> list[Any]:
        for kind in {lim.kind for lim in due} - self._sha.keys():
            self._sha[kind] = await self.client.script_load(SCRIPTS[kind])
        pipe = self.client.pipeline(transaction=False)
        for lim, call in zip(due, calls, strict=True):
            pipe.evalsha(self._sha[lim.kind], 1, lim.key, *ARGS[lim.kind](lim.rule, call, self.ttl, store_now))
        return list(await pipe.execute())

    async def run(self) -> None:
        """The renewal loop; run it as one task for the gateway's life, cancel it to stop."""
        while True:
            now = self.clock()
            await self.step(now)
            wake = now + self.tick
            for lim in self._limiters:
                if lim.hungry and lim.retry_at > now:
                    wake = min(wake, lim.retry_at)
            self._wake.clear()
            timeout = max(0.0, wake - self.clock())
            if timeout > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass

    async def close(self) -> None:
        """Settle every lease (so the store frees unspent units now) and close the client."""
        now = self.clock()
        for lim in self._limiters:
            lim.retire(now)
        await self.step(now)
        await self.client.aclose()
