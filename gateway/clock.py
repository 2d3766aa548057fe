"""The gateway's two clocks, each named once; every other module reads time through these.

* :func:`now` -- the **request clock**: monotonic seconds from an arbitrary zero
  (``time.perf_counter``, CLOCK_MONOTONIC on Linux). Every ``now`` handed to a
  sans-I/O core comes from it: a request's arrival ``t0``, admission and its rate
  limiters, load shedding, key-file checks, deadlines, the Redis lease loop. Its
  readings mean nothing outside this process, so none of them is ever sent
  anywhere: what crosses a process boundary is a *duration* (an age, a "valid for",
  a "retry in"), which needs no agreement between clocks.
* :func:`wall` (:func:`wall_ns`) -- Unix time, only for what leaves the process as a
  date: the HTTP ``Date`` header, a response's ``created``, a session ticket's issue
  time (RFC 8446 ticket ages are computed by the peer from it), trace span timestamps.

A third clock runs beside them and never meets them: the event loop's (``loop.time()``,
asyncio's monotonic clock), which the protocol adapters (HTTP/1.1, h2, h3, QUIC) and the
transport use for their own timers -- keep-alive, write and body timeouts, heartbeats --
each reading compared only with readings of the same clock. transport/ keeps
``time.perf_counter`` for a result's ``first_token_at``: the request clock is that clock plus
:data:`OFFSET` (0 outside tests), so the gateway converts by adding it (``api/call.py``).

Why this module exists: ``RedisLeases`` once ran on ``time.time`` while requests
reached the limiters with ``perf_counter`` readings, ~1.8e9 s apart, and every
request after the first was refused (issue #26). Limits shared in Redis now keep
their times on the Redis server's clock (``TIME`` in the scripts) and exchange
only durations with a gateway (:mod:`gateway.admission.redis_scripts`).

Test hook: ``QUICSERVE_TEST_CLOCK_OFFSET`` (seconds, may be negative) shifts both
clocks of this process, as a host whose clock is off would be; the real-process
Redis tests run two gateways 4 s apart. Unset (always, outside tests) the clocks
are the plain ``time`` functions, with no wrapper on the hot path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["now", "wall", "wall_ns", "OFFSET"]

OFFSET = float(os.environ.get("QUICSERVE_TEST_CLOCK_OFFSET") or 0.0)

now: Callable[[], float]
wall: Callable[[], float]
wall_ns: Callable[[], int]  # the same in integer nanoseconds (trace spans)

if OFFSET:
    _perf, _time = time.perf_counter, time.time

    def _now() -> float:
        return _perf() + OFFSET

    def _wall() -> float:
        return _time() + OFFSET

    def _wall_ns() -> int:
        return time.time_ns() + int(OFFSET * 1e9)

    now, wall, wall_ns = _now, _wall, _wall_ns
else:
    now, wall, wall_ns = time.perf_counter, time.time, time.time_ns
