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
window has room, atomically per key. The accuracy argument is in
:mod:`.lease`; the clock is the caller's (``now`` in the arguments), so
gateways on several hosts need synchronised clocks (NTP): a skew of e ms
moves each window edge by e.

Redis unreachable: ``fail_open`` admits and counts it (``fail_open_admits``,
``errors``), otherwise the limiters answer 503 until ``backoff`` has passed.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from .config import AdmissionSettings
from .lease import DEFAULT_LEASE_SHARE, DEFAULT_TTL, Grant, LeasedLimiter, Renewal
from .limiter import Limiter
from .limits import RateRule, local_limiter

__all__ = ["RedisLeases", "SCRIPT"]

# KEYS[1]: the limiter's hash. ARGV: now, window, width, slices, limit, want, need, ttl, old lease,
# new lease, carry (unspent units of the old lease the gateway keeps spending: re-granted first, they
# stay reserved), then (slice, units, latest-or--1) triples. Fields: c<slice>/l<slice> count and latest
# admission; L<lease> "units:expiry". Returns granted, start (when the lease may be spent, or when
# to retry if nothing was granted), used, reset -- as strings (Lua numbers become integers).
SCRIPT = """
local key = KEYS[1]
local function str(x) return string.format('%.17g', x) end  -- tostring keeps 14 digits: not enough for epoch times
local now, window, width = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local nslices, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local want, need, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local old, new, carry = ARGV[9], ARGV[10], tonumber(ARGV[11])
if old ~= '' then redis.call('HDEL', key, 'L' .. old) end
local i = 12
while i + 2 <= #ARGV do
  local k, units, last = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local c = tonumber(redis.call('HGET', key, 'c' .. k) or '0')
  if last >= 0 then
    local l = tonumber(redis.call('HGET', key, 'l' .. k) or '-1')
    redis.call('HSET', key, 'c' .. k, str(c + units), 'l' .. k, str(math.max(l, last)))
  elseif c > 0 then
    redis.call('HSET', key, 'c' .. k, str(math.max(0, c + units)))
  end
  i = i + 3
end
local all = redis.call('HGETALL', key)
local counts, lasts, frees = {}, {}, {}
local used, oldest, start = 0, math.floor(now / width) - nslices, now - window
local reset = now
for j = 1, #all, 2 do
  local f, v = all[j], all[j + 1]
  local tag = string.sub(f, 1, 1)
  if tag == 'c' then counts[string.sub(f, 2)] = tonumber(v)
  elseif tag == 'l' then lasts[string.sub(f, 2)] = tonumber(v)
  elseif tag == 'L' then
    local sep = string.find(v, ':')
    local g, exp = tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
    if exp <= now then redis.call('HDEL', key, f)
    else used = used + g; frees[#frees + 1] = {exp, g}; reset = math.max(reset, exp) end
  end
end
for k, c in pairs(counts) do
  local l = lasts[k] or -1
  if tonumber(k) < oldest or l <= start then redis.call('HDEL', key, 'c' .. k, 'l' .. k)
  else used = used + c; frees[#frees + 1] = {l + window, c}; reset = math.max(reset, l + window) end
end
local granted, start = 0, now
local free = limit - used
if new ~= '' and carry > 0 then
  -- the old lease goes on without a gap: its unspent units were counted and stay counted
  granted = carry
  if free - carry >= need then granted = carry + math.min(want, free - carry) end
  local exp = now + ttl + window
  redis.call('HSET', key, 'L' .. new, str(granted) .. ':' .. str(exp))
  used = used - carry + granted
  reset = math.max(reset, exp)
elseif new ~= '' then
  if free < need then
    -- full: lease what frees first, spendable from then (a future lease), counted from now
    table.sort(frees, function(a, b) return a[1] < b[1] end)
    start = now + window
    for _, e in ipairs(frees) do
      free = free + e[2]
      if free >= need then start = e[1]; break end
    end
  end
  if free >= need then
    granted = math.min(want, free)
    local exp = start + ttl + window
    redis.call('HSET', key, 'L' .. new, str(granted) .. ':' .. str(exp))
    used = used + granted
    reset = math.max(reset, exp)
  end
end
redis.call('PEXPIRE', key, math.ceil((window + ttl) * 1000) + 1000)
return {str(granted), str(start), str(used), str(reset)}
"""


def _rule_id(rule: RateRule) -> str:
    return hashlib.sha256(repr(rule).encode()).hexdigest()[:12]


class RedisLeases:
    """Limiter factory + renewal loop for limits shared in Redis (``redis.asyncio`` client)."""

    def __init__(self, client: Any, *, prefix: str = "quicserve:rl:", ttl: float = DEFAULT_TTL,
                 tick: float = 0.005, lease_share: float = DEFAULT_LEASE_SHARE, fail_open: bool = True,
                 backoff: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.prefix, self.ttl, self.tick, self.lease_share = prefix, ttl, tick, lease_share
        self.fail_open, self.backoff, self.clock = fail_open, backoff, clock
        self._instance = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._seq = itertools.count()
        self._limiters: set[LeasedLimiter] = set()
        self._wake = asyncio.Event()
        self._sha: str | None = None
        self.round_trips = 0
        self.errors = 0

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
        return sum(lim.fail_open_admits for lim in self._limiters)

    def make(self, rule: RateRule, value: str) -> Limiter:
        """The factory for :class:`RateLimits`/:class:`Admission`: one leased limiter per scope value.

        Token-bucket rules stay per gateway (a bucket's continuous refill has no shared slices);
        ``config check`` refuses them in ``[admission] limits`` when ``redis_url`` is set, and a key
        file's bucket rules are local by this rule.
        """
        if rule.algorithm != "window":
            return local_limiter(rule, value)
        key = f"{self.prefix}{_rule_id(rule)}:{value}"
        lim = LeasedLimiter(rule, key, self.ttl, self.lease_share, self.fail_open, self._next_id, self._hungry)
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
        if not due:
            return 0
        calls = [lim.renewal(now, self.tick * 2) for lim in due]
        try:
            if self._sha is None:
                self._sha = await self.client.script_load(SCRIPT)
            pipe = self.client.pipeline(transaction=False)
            for lim, call in zip(due, calls, strict=True):
                pipe.evalsha(self._sha, 1, lim.key, *self._args(lim.rule, call))
            replies = await pipe.execute()
            self.round_trips += 1
        except Exception as e:  # any failure of the store: fall back as configured
            if "NOSCRIPT" in str(e):
                self._sha = None
            self.errors += 1
            for lim, call in zip(due, calls, strict=True):
                lim.failed(call, now, self.backoff)
            return len(calls)
        for lim, call, reply in zip(due, calls, replies, strict=True):
            g, start, used, reset = (float(x) for x in reply)
            lim.granted(call, Grant(g, start, used, reset))
        return len(calls)

    def _args(self, rule: RateRule, call: Renewal) -> list[str]:
        out = [repr(call.now), repr(rule.window), repr(rule.window / rule.slices), str(rule.slices),
               repr(rule.limit), repr(call.want), repr(call.need), repr(self.ttl), call.old_lease, call.new_lease,
               repr(call.carry)]
        for k, units, last in call.deltas:
            out += [str(k), repr(units), repr(last)]
        return out

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
