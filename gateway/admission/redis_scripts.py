"""The Lua scripts that keep shared limits in Redis, and their arguments; no I/O.

Every time a script keeps is the Redis server's own (``TIME``, read inside the
script): the store has one clock whatever the number of gateways, and no
gateway's clock -- skewed, or a monotonic clock with its own zero -- ever reaches
it. A gateway sends ages (seconds before the call) and reads durations (seconds
from when the script ran); :mod:`.lease` turns them into its own times. Before
this, the scripts took ``now`` from the gateway, which ran on another clock
than its request path (issue #26).

``ARGV[1]`` is the one exception, for tests only: a fixed "now" for the script
in place of ``TIME`` (``''`` in production), so fake-clock tests can step a real
Redis through many windows in no time.

Numbers cross as strings: ``%.17g`` on the Lua side (``tostring`` keeps 14
digits, not enough for epoch seconds), ``repr`` on ours.
"""

from __future__ import annotations

from .lease import Renewal
from .limits import RateRule

__all__ = ["WINDOW", "BUCKET", "SCRIPTS", "window_args", "bucket_args", "ARGS"]

_PRELUDE = """
local key = KEYS[1]
local function str(x) return string.format('%.17g', x) end
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
"""

# The sliding window of .window, shared. ARGV: now, window, width, slices, limit, want, need, ttl, old lease,
# new lease, carry (unspent units of the old lease the gateway keeps spending: re-granted first, they stay
# reserved), then (age, units, kind) triples: kind 's', a spend whose latest admission was ``age`` seconds
# before the call; 'c', a correction (negative units) to the slice of a spend settled earlier, named by
# that spend's age. Fields: c<slice>/l<slice> count and latest admission; L<lease> "units:expiry";
# F<lease> when a future lease may be spent (it counts from then: see below).
# Returns granted, start_in (the lease may be spent from then; if nothing was granted, when to retry),
# used, reset_in, recheck_in (a future lease or none: when a lease now counted ends and may give units
# back, so asking again may start sooner; negative: none).
WINDOW = _PRELUDE + """
local window, width = tonumber(ARGV[2]), tonumber(ARGV[3])
local nslices, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local want, need, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local old, new, carry = ARGV[9], ARGV[10], tonumber(ARGV[11])
if old ~= '' then redis.call('HDEL', key, 'L' .. old, 'F' .. old) end
local i = 12
while i + 2 <= #ARGV do
  local at, units, kind = now - tonumber(ARGV[i]), tonumber(ARGV[i + 1]), ARGV[i + 2]
  local k = str(math.floor(at / width))
  local c = tonumber(redis.call('HGET', key, 'c' .. k) or '0')
  if kind == 's' then
    local l = tonumber(redis.call('HGET', key, 'l' .. k) or '-1')
    redis.call('HSET', key, 'c' .. k, str(c + units), 'l' .. k, str(math.max(l, at)))
  elseif c > 0 then
    redis.call('HSET', key, 'c' .. k, str(math.max(0, c + units)))
  end
  i = i + 3
end
-- The count from now on, as a list of changes: a slice leaves at its latest admission + window, a
-- lease at its expiry; a future lease (F<lease>: when it may be spent) counts only from then, so
-- units given back before it starts are free to others meanwhile.
local all = redis.call('HGETALL', key)
local counts, lasts, starts, leases, events = {}, {}, {}, {}, {}
local used, oldest, gone = 0, math.floor(now / width) - nslices, now - window
local reset, recheck = now, math.huge
for j = 1, #all, 2 do
  local f, v = all[j], all[j + 1]
  local tag = string.sub(f, 1, 1)
  if tag == 'c' then counts[string.sub(f, 2)] = tonumber(v)
  elseif tag == 'l' then lasts[string.sub(f, 2)] = tonumber(v)
  elseif tag == 'F' then starts[string.sub(f, 2)] = tonumber(v)
  elseif tag == 'L' then leases[string.sub(f, 2)] = v end
end
for id, v in pairs(leases) do
  local sep = string.find(v, ':')
  local g, exp = tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
  local s = starts[id] or now
  if exp <= now then redis.call('HDEL', key, 'L' .. id, 'F' .. id)
  else
    if s <= now then
      used = used + g
      -- a lease being spent ends (and its holder settles) at exp - window: units may come back then;
      -- one past its end is not settled yet (a holder starved of CPU, or gone): within a lease life
      recheck = math.min(recheck, math.max(exp - window, now + ttl))
    else events[#events + 1] = {s, g} end
    events[#events + 1] = {exp, -g}
    reset = math.max(reset, exp)
  end
end
for id, _ in pairs(starts) do
  if not leases[id] then redis.call('HDEL', key, 'F' .. id) end
end
for k, c in pairs(counts) do
  local l = lasts[k] or -1
  if tonumber(k) < oldest or l <= gone then redis.call('HDEL', key, 'c' .. k, 'l' .. k)
  else used = used + c; events[#events + 1] = {l + window, -c}; reset = math.max(reset, l + window) end
end
-- what is counted after each change (a change leaving before one arriving at the same time), and the
-- most counted from each change on: a lease granted from then must fit under the limit until it ends
table.sort(events, function(a, b) if a[1] ~= b[1] then return a[1] < b[1] end return a[2] < b[2] end)
local after, peak = {}, {}
local level = used
for j, e in ipairs(events) do level = level + e[2]; after[j] = level end
local top = -math.huge
for j = #events, 1, -1 do top = math.max(top, after[j]); peak[j] = top end
used = math.max(used, peak[1] or -math.huge)  -- the most counted from now on
local granted, start = 0, now
local free = limit - used
if new ~= '' and carry > 0 then
  -- the old lease goes on without a gap: its unspent units were counted and stay counted
  granted = carry
  if free - carry >= need then granted = carry + math.min(want, free - carry) end
  local exp = now + ttl + window
  redis.call('HSET', key, 'L' .. new, str(granted) .. ':' .. str(exp))
  used = used + granted
  reset = math.max(reset, exp)
elseif new ~= '' then
  if free < need then
    -- full: lease what frees first, spendable from then (a future lease, counted from then)
    start = now + window
    for j, e in ipairs(events) do
      if (events[j + 1] == nil or events[j + 1][1] > e[1]) and limit - peak[j] >= need then
        start, free = e[1], limit - peak[j]
        break
      end
    end
  end
  if free >= need then
    granted = math.min(want, free)
    local exp = start + ttl + window
    redis.call('HSET', key, 'L' .. new, str(granted) .. ':' .. str(exp))
    if start > now then redis.call('HSET', key, 'F' .. new, str(start)) else used = used + granted end
    reset = math.max(reset, exp)
  end
end
redis.call('PEXPIRE', key, math.ceil((window + ttl) * 1000) + 1000)
if granted > 0 and start <= now then recheck = math.huge end
if recheck == math.huge then recheck = now - 1 end
return {str(granted), str(start - now), str(used), str(reset - now), str(recheck - now)}
"""

# The token bucket of .bucket, shared as GCRA: the key holds the bucket's theoretical arrival time
# (TAT): the bucket is full at TAT and holds burst - (TAT - now) * rate before it; no key = full.
# ARGV: now, rate (units/s), burst, want, need, carry, returned (unspent units of a lease that ended,
# given back), debit (units spent on credit less refunds; negative gives back), new lease ('' = settle
# only). Give-backs are capped at a full bucket (TAT >= now). Returns granted, start_in, used, reset_in.
BUCKET = _PRELUDE + """
local rate, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
local want, need, carry = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local returned, debit, new = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local tat = tonumber(redis.call('GET', key) or '0')
tat = math.max(now, math.max(tat, now) + (debit - returned) / rate)
local level = burst - (tat - now) * rate
local granted, start = 0, now
if new ~= '' then
  if level >= need then
    local g = math.min(want, level)
    granted = carry + g
    tat = tat + g / rate
  elseif carry > 0 then
    granted = carry  -- the old lease goes on; nothing more for now
  else
    -- empty: lease the next `need` units, spendable once the bucket has them (a future lease)
    granted = need
    tat = tat + need / rate
    start = tat - burst / rate
  end
end
if tat > now then
  redis.call('SET', key, str(tat), 'PX', math.ceil((tat - now) * 1000) + 1000)
else
  redis.call('DEL', key)
end
return {str(granted), str(start - now), str((tat - now) * rate), str(tat - now)}
"""

SCRIPTS = {"window": WINDOW, "bucket": BUCKET}


def window_args(rule: RateRule, call: Renewal, ttl: float, now: str) -> list[str]:
    out = [now, repr(rule.window), repr(rule.window / rule.slices), str(rule.slices), repr(rule.limit),
           repr(call.want), repr(call.need), repr(ttl), call.old_lease, call.new_lease, repr(call.carry)]
    for age, units, spend in call.deltas:
        out += [repr(age), repr(units), "s" if spend else "c"]
    return out


def bucket_args(rule: RateRule, call: Renewal, ttl: float, now: str) -> list[str]:
    del ttl  # a bucket lease's units are taken at once: nothing in the store expires with it
    return [now, repr(rule.limit / rule.window), repr(rule.burst or rule.limit), repr(call.want), repr(call.need),
            repr(call.carry), repr(call.returned), repr(call.debit), call.new_lease]


ARGS = {"window": window_args, "bucket": bucket_args}
