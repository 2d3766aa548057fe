"""The run: send prepared requests open loop (at arrival times) or closed loop, record each.

How it works: the open loop walks the arrival times, sleeps until each, and starts one task
per request (a ``--max-concurrency`` guard makes an arrival wait for a free slot, as vLLM's
does; how late each request left is kept as its ``start - scheduled``). The closed loop runs
``concurrency`` coroutines that each send the next request when theirs ends. Either stops
starting requests at the request count or the duration, then waits for those in flight.
Requests started in the first ``warmup`` seconds are sent and recorded but marked warm-up,
and not counted in the figures.

The client's own cost is part of the result: its CPU time (``getrusage``) over the wall
time. One Python process uses one core; near 100% of it the client, not the server, may be
what the figures measure, and the run says so.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .records import Record

__all__ = ["Sender", "LoadSpec", "Prepared", "RunOutcome", "run_load", "SATURATED_CPU", "inf_safe"]

SATURATED_CPU = 0.9  # of one core: past it the client may be the bottleneck


class Sender(Protocol):
    def prepare(self, body: bytes) -> bytes: ...

    async def send(self, payload: bytes, rec: Record) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to send: the sender's bytes, the client's prompt estimate, max_tokens."""

    payload: bytes
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How to send: ``rate`` requests/s (open loop; inf: all at once) or ``concurrency`` (closed)."""

    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: float = 0.0
    duration: float | None = None
    num_requests: int | None = None
    seed: int = 0
    arrivals: Sequence[float] | None = None  # a trace's arrival times (instead of rate)


@dataclass(slots=True)
class RunOutcome:
    records: list[Record]
    wall_s: float
    cpu_user_s: float
    cpu_sys_s: float
    started_unix: float
    max_in_flight: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def cpu_fraction(self) -> float:
        return (self.cpu_user_s + self.cpu_sys_s) / self.wall_s if self.wall_s > 0 else 0.0

    def client_json(self) -> dict[str, object]:
        lags = sorted(r.start - r.scheduled for r in self.records)
        return {"wall_s": self.wall_s, "cpu_user_s": self.cpu_user_s, "cpu_sys_s": self.cpu_sys_s,
                "cpu_fraction_of_one_core": self.cpu_fraction, "saturated": self.cpu_fraction >= SATURATED_CPU,
                "send_lag_p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3 if lags else 0.0,
                "max_in_flight": self.max_in_flight, "notes": self.notes}


def _times(spec: LoadSpec) -> Iterator[float]:
    from .arrivals import arrival_times

    if spec.arrivals is not None:
        return iter(spec.arrivals)
    assert spec.rate is not None
    return arrival_times(spec.rate, burstiness=spec.burstiness, seed=spec.seed)


def _stop(spec: LoadSpec, measured: int, t: float) -> bool:
    if spec.num_requests is not None and measured >= spec.num_requests:
        return True
    return spec.duration is not None and t >= spec.warmup + spec.duration


async def run_load(sender: Sender, payloads: Sequence[Prepared], spec: LoadSpec, *,
                   now: Callable[[], float] = time.perf_counter,
                   progress: Callable[[int], None] | None = None) -> RunOutcome:
    """Send ``payloads`` in turn (from the first again when more requests are asked for)."""
    if not payloads:
        raise ValueError("no requests to send")
    if spec.num_requests is None and spec.duration is None and spec.arrivals is None:
        raise ValueError("give a request count, a duration or a trace")
    records: list[Record] = []
    in_flight = 0
    peak = 0
    t0 = now()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    wall0 = time.time()

    async def one(rec: Record, payload: bytes) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        rec.start = now()  # on the sender's clock; made relative to t0 below
        try:
            await sender.send(payload, rec)
        finally:
            in_flight -= 1
            if progress is not None and not rec.warmup:
                progress(1)

    if spec.concurrency is not None and spec.rate is None and spec.arrivals is None:
        await _closed(spec, payloads, records, one, lambda: now() - t0)
    else:
        await _open(spec, payloads, records, one, lambda: now() - t0)
    wall = now() - t0
    for r in records:
        r.start -= t0
        r.end -= t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    out = RunOutcome(records, wall, ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime, wall0, peak)
    if out.cpu_fraction >= SATURATED_CPU:
        out.notes.append(f"client saturated: it used {out.cpu_fraction:.0%} of a core; the figures may "
                         "measure the client (use --processes)")
    return out


async def _open(spec: LoadSpec, payloads: Sequence[Prepared], records: list[Record],
                one: Callable[[Record, bytes], Awaitable[None]], elapsed: Callable[[], float]) -> None:
    sem = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    tasks: set[asyncio.Task[None]] = set()
    measured = 0
    loop = asyncio.get_running_loop()
    for i, at in enumerate(_times(spec)):
        if _stop(spec, measured, at):
            break
        delay = at - elapsed()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        p = payloads[i % len(payloads)]
        rec = Record(i, at, prompt_tokens=p.prompt_len, expected_output=p.output_len, warmup=at < spec.warmup)
        measured += not rec.warmup
        records.append(rec)
        task = loop.create_task(_guarded(one, rec, p.payload, sem))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def _guarded(one: Callable[[Record, bytes], Awaitable[None]], rec: Record, payload: bytes,
                   sem: asyncio.Semaphore | None) -> None:
    try:
        await one(rec, payload)
    finally:
        if sem is not None:
            sem.release()


async def _closed(spec: LoadSpec, payloads: Sequence[Prepared], records: list[Record],
                  one: Callable[[Record, bytes], Awaitable[None]], elapsed: Callable[[], float]) -> None:
    assert spec.concurrency is not None
    counter = iter(range(1 << 62))
    measured = 0

    async def client() -> None:
        nonlocal measured
        while True:
            t = elapsed()
            if _stop(spec, measured, t):
                return
            i = next(counter)
            p = payloads[i % len(payloads)]
            rec = Record(i, t, prompt_tokens=p.prompt_len, expected_output=p.output_len, warmup=t < spec.warmup)
            measured += not rec.warmup
            records.append(rec)
            await one(rec, p.payload)

    await asyncio.gather(*(client() for _ in range(spec.concurrency)))


def inf_safe(x: float | None) -> float | str | None:
    """A rate for JSON (inf has no JSON spelling)."""
    return "inf" if x is not None and math.isinf(x) else x

