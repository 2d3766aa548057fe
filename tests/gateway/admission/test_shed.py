"""Load shedding: pool bounds by priority class, deadlines against the wait estimate, key caps."""

from __future__ import annotations

import pytest

from gateway.admission.shed import LoadShedder, WaitEstimator
from gateway.errors import APIError


def test_lowest_class_shed_first() -> None:
    """queue_limit 100, 3 classes, headroom 0.1: class 0 enters below 80, 1 below 90, 2 below 100."""
    s = LoadShedder(queue_limit=100, classes=3, headroom=0.1)
    assert [s.bound(p) for p in (0, 1, 2, 9, -1)] == [80, 90, 100, 100, 80]
    tickets = [s.admit("m", None, 0, 2, None, 0.0) for _ in range(80)]
    with pytest.raises(APIError) as e:
        s.admit("m", None, 0, 0, None, 0.0)
    assert (e.value.status, e.value.code) == (503, "overloaded") and e.value.retry_after is not None
    tickets += [s.admit("m", None, 0, 1, None, 0.0) for _ in range(10)]
    with pytest.raises(APIError):
        s.admit("m", None, 0, 1, None, 0.0)
    tickets += [s.admit("m", None, 0, 2, None, 0.0) for _ in range(10)]
    with pytest.raises(APIError):
        s.admit("m", None, 0, 2, None, 0.0)
    assert s.outstanding("m") == 100 and s.shed == 3
    s.release(tickets.pop(), 1.0)
    s.admit("m", None, 0, 2, None, 1.0)
    assert s.outstanding("other") == 0  # pools are separate
    s.admit("other", None, 0, 0, None, 1.0)


def test_estimator_counts_busy_time_only() -> None:
    est = WaitEstimator(alpha=1.0)
    assert est.wait(10) == 0.0  # nothing observed: no prediction
    est.started(0.0, 0)
    est.completed(0.5, 0)  # busy 0.0-0.5: one completion in 0.5 s
    assert est.wait(4) == pytest.approx(2.0)
    est.started(100.0, 0)  # idle 0.5-100 is not service time
    est.completed(100.25, 1)
    assert est.gap == pytest.approx(0.25)


def test_deadline_shorter_than_predicted_wait_is_refused_at_once() -> None:
    """A pool serving one request per 0.1 s with 20 outstanding predicts a 2 s wait."""
    s = LoadShedder(queue_limit=1000)
    t, held = 0.0, []
    for _ in range(21):
        held.append(s.admit("m", None, 0, 1, None, t))
    for _ in range(5):  # steady service: a completion every 0.1 s, a new arrival each time
        t += 0.1
        s.release(held.pop(0), t)
        held.append(s.admit("m", None, 0, 1, None, t))
    assert s.outstanding("m") == 21
    with pytest.raises(APIError) as e:
        s.admit("m", None, 0, 1, 1.5, t)
    assert e.value.status == 503 and "deadline" in e.value.message
    assert s.admit("m", None, 0, 1, 2.5, t) is not None  # a deadline past the wait gets in
    assert s.admit("m", None, 0, 1, None, t) is not None  # no deadline: only the bound applies


def test_key_concurrency_cap() -> None:
    s = LoadShedder()
    a = [s.admit("m", "k1", 2, 1, None, 0.0) for _ in range(2)]
    with pytest.raises(APIError) as e:
        s.admit("m", "k1", 2, 1, None, 0.0)
    assert (e.value.status, e.value.code) == (429, "rate_limit_exceeded")
    s.admit("m", "k2", 2, 1, None, 0.0)  # another key is not affected
    s.release(a[0], 1.0)
    s.admit("m", "k1", 2, 1, None, 1.0)


def test_memory_bounded_under_churn() -> None:
    """Thousands of keys and pool names come and go; what is held tracks what is outstanding."""
    s = LoadShedder(queue_limit=10_000, max_pools=16)
    for i in range(5000):
        t = s.admit(f"model-{i % 200}", f"key-{i}", 1, 1, None, float(i))
        s.release(t, float(i) + 0.5)
    pools, keys = s.tracked()
    assert pools <= 16 and keys == 0


async def test_saturated_worker_sheds_at_once_and_admitted_finish() -> None:
    """A worker serving 4 at a time for 10 ms each is offered 2.5x what it can do, with deadlines.

    Refusals are synchronous (no await between arrival and 503): their latency is far below one
    service time. Every admitted request finishes, and outstanding requests never pass the bound.
    """
    import asyncio
    import statistics
    import time

    from gateway.admission import Admission, AdmissionContext, AdmissionSettings

    service, slots, bound = 0.010, 4, 16
    adm = Admission.from_settings(AdmissionSettings(queue_limit=bound, priority_classes=1))
    worker = asyncio.Semaphore(slots)
    finished, refused_latency, peak = 0, [], 0

    async def serve(grant: object) -> None:
        nonlocal finished
        async with worker:
            await asyncio.sleep(service)
        adm.release(grant, 1, time.monotonic())  # type: ignore[arg-type]
        finished += 1

    tasks = []
    for _ in range(250):
        t = time.monotonic()
        try:
            grant = adm.admit(AdmissionContext(None, None, "tiny", "/v1/completions", 1, 1, deadline=0.5), t)
        except APIError as e:
            assert e.status == 503 and e.retry_after is not None
            refused_latency.append(time.monotonic() - t)
        else:
            tasks.append(asyncio.ensure_future(serve(grant)))
        peak = max(peak, adm.outstanding())
        await asyncio.sleep(service / (2.5 * slots))  # arrivals at 2.5x the service rate
    await asyncio.gather(*tasks)
    assert refused_latency and tasks
    assert finished == len(tasks) and adm.outstanding() == 0
    assert peak <= bound
    assert statistics.median(refused_latency) < service / 10


def test_memory_does_not_grow_with_requests_under_overload() -> None:
    """Peak traced memory of 8k overloaded requests, each from a new client, is that of 1k."""
    import tracemalloc

    from gateway.admission import Admission, AdmissionContext, AdmissionSettings

    def run(n: int) -> int:
        adm = Admission.from_settings(AdmissionSettings(limits=["client requests 100/1s"], queue_limit=64,
                                                        limiter_max_keys=256))
        live: list[object] = []
        tracemalloc.start()
        for i in range(n):
            now = i * 0.001
            client = f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}"  # every request from a new address
            ctx = AdmissionContext(None, client, "tiny", "/v1/completions", 1, 1)
            try:
                live.append(adm.admit(ctx, now))
            except APIError:
                pass
            if len(live) > 48:  # a worker finishing the oldest
                adm.release(live.pop(0), 1, now)  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small, large = run(1000), run(8000)
    assert large < small * 1.5
