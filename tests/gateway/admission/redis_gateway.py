"""One 'gateway' process for the two-process Redis test: offers requests at a fixed rate for a
while, admits them through Admission with Redis-leased limiters, prints admission times as JSON.

Usage: python -m tests.gateway.admission.redis_gateway URL RULE DURATION RATE; prints "ready" once
imported and connected, then reads the common start time (epoch seconds) from stdin.
"""

from __future__ import annotations

import asyncio
import sys
import time

import orjson

from gateway import clock
from gateway.admission import Admission, AdmissionContext, AdmissionSettings
from gateway.admission.redis_limits import RedisLeases
from gateway.errors import APIError


async def main(url: str, rule: str, duration: float, rate: float) -> None:
    leases = RedisLeases.from_url(url)
    await leases.client.ping()
    adm = Admission.from_settings(AdmissionSettings(limits=[rule], queue_limit=1 << 30), leases.make)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    start = float(await asyncio.to_thread(sys.stdin.readline))
    refresher = asyncio.create_task(leases.run())
    await asyncio.sleep(max(0.0, start - time.time()))
    admitted: list[float] = []
    arrivals: list[float] = []
    offered = 0
    ctx = AdmissionContext(None, "10.0.0.1", "tiny", "/v1/chat/completions", 1, 1)
    t0 = time.time()
    while True:
        now = time.time()
        if now >= start + duration:
            break
        due = int((now - t0) * rate) + 1
        while offered < due:  # catch up on the arrivals a late wake-up missed, each at its own time
            offered += 1
            arrivals.append(now)
            t = clock.now()  # the request clock (the renewal loop's); the log is in wall time
            try:
                adm.release(adm.admit(ctx, t), 1, t)
                admitted.append(now)
            except APIError:
                pass
        await asyncio.sleep(0.0005)
    refresher.cancel()
    await leases.close()
    sys.stdout.write(orjson.dumps({"admitted": admitted, "began": t0, "arrivals": arrivals, "offered": offered, "errors": leases.errors,
                                   "round_trips": leases.round_trips}).decode())


if __name__ == "__main__":
    url, rule, duration, rate = sys.argv[1:5]
    asyncio.run(main(url, rule, float(duration), float(rate)))
