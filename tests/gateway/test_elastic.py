"""The elastic pool controller on a fake clock, and the simulator's comparison in small (issue #35)."""

from __future__ import annotations

import random
import statistics

import pytest

from gateway.workers.elastic import (
    HORIZON_MAX_S,
    HORIZON_MIN_S,
    ElasticController,
    PoolLimits,
    PoolView,
    ReactiveController,
    ReplicaView,
    StartupTimes,
    replicas_for,
)
from gateway.workers.elastic_model import WaitCorrection, erlang_c, mean_queue
from gateway.workers.elastic_sim import Startup, bursty_trace, simulate

SLOTS = 8
CAPACITY = 4.0  # requests/s per replica: 8 slots, 2 s per request


def view(ready: int, *, starting: int = 0, busy: int = 0, queued: int = 0, oldest: float = 0.0,
         draining: tuple[int, ...] = ()) -> PoolView:
    replicas = tuple(ReplicaView(i, busy, i in draining) for i in range(ready))
    return PoolView(replicas, starting, SLOTS, CAPACITY, queued, oldest)


def arrivals(ctl: ElasticController, start: float, end: float, rps: float) -> float:
    """Evenly spaced arrivals at ``rps`` over [start, end); returns ``end``."""
    t = start
    while t < end:
        ctl.observe_arrival(t)
        t += 1 / rps
    return end


def test_horizon_is_p90_plus_two_sigma() -> None:
    st = StartupTimes()
    samples = [0.5, 0.6, 0.6, 0.7, 0.7, 0.7, 0.8, 0.8, 0.9, 1.0]
    for s in samples:
        st.add(s)
    # inclusive P90 of ten sorted values: 0.9 + 0.1 * (1.0 - 0.9) = 0.91
    expected = 0.91 + 2 * statistics.stdev(samples)
    assert st.horizon() == pytest.approx(expected)
    assert HORIZON_MIN_S < st.horizon() < HORIZON_MAX_S


def test_horizon_is_clamped() -> None:
    fast, slow = StartupTimes(), StartupTimes()
    for _ in range(10):
        fast.add(0.05)
        slow.add(5.0)
    assert fast.horizon() == HORIZON_MIN_S
    assert slow.horizon() == HORIZON_MAX_S
    assert StartupTimes().horizon() == HORIZON_MAX_S  # nothing measured yet: the cautious end


def test_scales_out_on_a_ramp_before_the_queue_passes_its_budget() -> None:
    """A ramp from 2 to 30 rps over 20 s: the controller asks for replicas while nothing is queued,
    and what it has asked for covers the rate one horizon later."""
    lim = PoolLimits(min_replicas=1, max_replicas=20, queue_budget_s=0.5, idle_s=30)
    ctl = ElasticController(lim)
    for _ in range(8):
        ctl.observe_startup(0.7)
    t, have = 0.0, 1
    while t < 20.0:
        rps = 2 + 28 * t / 20
        ctl.observe_arrival(t)
        d = ctl.decide(t, view(have, busy=0))  # an empty queue: only the forecast can ask
        have += d.start
        t += 1 / rps
    assert have * CAPACITY >= 30.0  # the ramp's end is covered before it came
    reactive = ReactiveController(lim)
    assert reactive.decide(t, view(1)).start == 0  # reactive has not moved: nothing queued


def test_reactive_starts_only_past_the_budget() -> None:
    lim = PoolLimits(min_replicas=1, max_replicas=10, queue_budget_s=0.5)
    r = ReactiveController(lim)
    assert r.decide(0.0, view(1, busy=SLOTS, queued=20, oldest=0.4)).start == 0
    assert r.decide(0.1, view(1, busy=SLOTS, queued=20, oldest=0.6)).start == 3  # ceil(20 / 8)


def test_scales_in_once_the_surplus_is_forecast_to_last_draining_first() -> None:
    lim = PoolLimits(min_replicas=1, max_replicas=10, queue_budget_s=0.5, idle_s=30)
    ctl = ElasticController(lim)
    dwell = min(lim.idle_s, ctl.slow.memory_s)
    assert dwell == pytest.approx(10.0)  # the slow rate's time constant, under idle_s
    t = arrivals(ctl, 0.0, 60.0, 1.0)  # 1 rps: one replica is plenty
    v = view(4, busy=1)
    drained: tuple[int, ...] = ()
    first = None
    while t < 120.0:
        if t == int(t):  # still 1 rps
            ctl.observe_arrival(t)
        d = ctl.decide(t, v)
        assert d.start == 0
        if d.drain:
            drained, first = d.drain, t
            break
        t += 0.5
    assert first is not None and first >= 60.0 + dwell - 0.5  # not before the dwell of surplus
    assert first < 60.0 + lim.idle_s  # but sooner than an idle timer: the slow rate says it lasts
    assert len(drained) == 3 and 0 not in drained  # down to one, the oldest kept
    # a draining replica no longer counts as serving: the pool does not replace it
    after = view(4, busy=1, draining=drained)
    assert ctl.decide(t + 0.5, after).start == 0
    assert [r.id for r in after.serving] == [0]


def test_keeps_a_burst_s_replicas_until_the_slow_rate_has_come_down() -> None:
    """30 rps for 20 s, then 1 rps: no drain while the slow rate still covers the burst, the pool back
    to one replica well within idle_s x replicas (the reactive scaler drains one per idle_s)."""
    lim = PoolLimits(min_replicas=1, max_replicas=12, queue_budget_s=0.5, idle_s=30)
    ctl = ElasticController(lim)
    for _ in range(8):
        ctl.observe_startup(0.7)
    t = arrivals(ctl, 0.0, 20.0, 30.0)
    have = 0
    have += ctl.decide(t, view(have)).start
    assert have >= 30.0 / CAPACITY
    drains: list[float] = []
    while t < 120.0 and have > 1:
        ctl.observe_arrival(t)
        d = ctl.decide(t, view(have))
        assert d.start == 0
        if d.drain:
            drains.append(t)
            have -= len(d.drain)
        t += 1.0
    assert drains and drains[0] >= 20.0 + 10.0  # the slow rate's memory first
    assert have == 1 and t < 20.0 + 3 * lim.idle_s


def test_a_poisson_blip_does_not_start_a_replica() -> None:
    """A steady 4 rps with a 1-second clump of 8 arrivals: the fast rate jumps, but not past the slow
    one by its noise, so nothing starts (a burst of 5x does)."""
    lim = PoolLimits(min_replicas=1, max_replicas=12, queue_budget_s=0.5, idle_s=30)
    ctl = ElasticController(lim)
    for _ in range(8):
        ctl.observe_startup(0.7)
    t = arrivals(ctl, 0.0, 60.0, 4.0)
    have = ctl.size(ctl.slow.level, view(1))
    assert ctl.decide(t, view(have)).start == 0
    t = arrivals(ctl, t, t + 1.0, 8.0)
    assert ctl.decide(t, view(have)).start == 0
    t = arrivals(ctl, t, t + 2.0, 20.0)
    assert ctl.decide(t, view(have)).start > 0


def test_the_wait_model_is_corrected_by_the_queue_it_observes() -> None:
    """A queue shorter than M/M/c predicts (as with service times less variable than exponential)
    lowers the correction, and the same demand then needs no more replicas; a longer one raises it."""
    short, long_ = WaitCorrection(), WaitCorrection()
    assert short.factor == 1.0
    predicted = mean_queue(24, 18.0)
    for _ in range(3000):
        short.observe(0.1, 0, predicted)
        long_.observe(0.1, 5, predicted)
    assert 0.25 <= short.factor < 0.5 and 1.5 < long_.factor <= 2.0
    base = replicas_for(9.0, CAPACITY, SLOTS, 0.5, 0.01, 20)
    assert replicas_for(9.0, CAPACITY, SLOTS, 0.5, 0.01, 20, short.factor) <= base
    assert replicas_for(9.0, CAPACITY, SLOTS, 0.5, 0.01, 20, long_.factor) >= base
    assert erlang_c(8, 0.0) == 0.0 and erlang_c(8, 8.0) == 1.0 and mean_queue(8, 9.0) == float("inf")


def test_never_below_min_nor_above_max() -> None:
    lim = PoolLimits(min_replicas=2, max_replicas=5, queue_budget_s=0.5, idle_s=10)
    ctl = ElasticController(lim)
    t = arrivals(ctl, 0.0, 10.0, 200.0)  # far past five replicas
    d = ctl.decide(t, view(2))
    assert d.start == 3  # up to max, no further
    assert ctl.decide(t + 0.1, view(2, starting=3)).start == 0
    quiet = ElasticController(lim)
    for step in range(400):  # no arrivals at all for 200 s
        assert quiet.decide(step * 0.5, view(2)).drain == ()
    assert quiet.decide(0.0, view(0)).start == 2  # below min (a replica died): back to min


def test_scale_to_zero_and_back() -> None:
    lim = PoolLimits(min_replicas=0, max_replicas=4, queue_budget_s=0.5, idle_s=20)
    ctl = ElasticController(lim)
    t = arrivals(ctl, 0.0, 10.0, 2.0)
    drained: tuple[int, ...] = ()
    while t < 60.0 and not drained:
        drained = ctl.decide(t, view(1)).drain
        t += 0.5
    assert drained == (0,)
    assert 10.0 + 20.0 <= t <= 10.0 + 2 * 20.0  # after idle_s without an arrival, not long after
    ctl.observe_arrival(t)  # the first request after the lull waits in the queue
    assert ctl.decide(t, view(0, queued=1, oldest=0.0)).start == 1


def test_simulated_scale_to_zero_first_request_waits_one_cold_start() -> None:
    lim = PoolLimits(min_replicas=0, max_replicas=4, queue_budget_s=0.5, idle_s=10)
    trace = bursty_trace(seed=3, duration_s=120.0, base_rps=0.5, trough=1.0, burst_every_s=1e9)
    late = [a for a in trace.arrivals if a > 60.0]
    gap = type(trace)((0.0, *late[:1]), trace.service[:2], 120.0, 0.5, 0.0)
    startup = Startup(median_s=0.7, sigma=0.0)  # every start takes 0.7 s
    r = simulate(gap, ElasticController(lim), slots=SLOTS, initial=0, startup=startup)
    assert r.waits[0] == pytest.approx(0.7)  # from zero: the first request waits a start
    assert r.waits[1] == pytest.approx(0.7)  # the pool went back to zero in the lull
    assert r.starts == 2


def test_erlang_sizing_grows_with_rate_and_tightness() -> None:
    assert replicas_for(0.0, CAPACITY, SLOTS, 0.5, 0.01, 10) == 0
    sizes = [replicas_for(rate, CAPACITY, SLOTS, 0.5, 0.01, 50) for rate in (1, 4, 16, 64)]
    assert sizes == sorted(sizes) and sizes[-1] >= 64 / CAPACITY
    assert replicas_for(16, CAPACITY, SLOTS, 0.5, 0.001, 50) >= replicas_for(16, CAPACITY, SLOTS, 0.5, 0.1, 50)


def test_elastic_beats_reactive_on_p95_wait_in_a_small_run() -> None:
    """Five simulated minutes, a burst of 5x at 90 s for 60 s: the elastic pool's p95 queue wait is
    below the reactive one's, and it uses far fewer replica-seconds than a pool sized for the peak."""
    trace = bursty_trace(seed=7, duration_s=300.0, base_rps=8.0, period_s=300.0, trough=0.6,
                         burst_every_s=1e9)
    bursty = type(trace)  # insert the burst by hand: one, at a known time
    rng = random.Random(7)
    extra = []
    t = 90.0
    while t < 150.0:
        t += rng.expovariate(32.0)
        extra.append(t)
    arrivals_ = sorted([*trace.arrivals, *extra[:-1]])
    service = tuple(rng.lognormvariate(0.57, 0.47) for _ in arrivals_)  # mean ~2 s
    trace = bursty(tuple(arrivals_), service, 300.0, 40.0, len(arrivals_) / 300.0, (90.0,))
    lim = PoolLimits(min_replicas=1, max_replicas=28, queue_budget_s=0.5, idle_s=30)
    elastic = ElasticController(lim)
    hist = random.Random(1)
    for _ in range(16):
        elastic.observe_startup(Startup().draw(hist))
    e = simulate(trace, elastic, slots=SLOTS, initial=2, seed=1)
    r = simulate(trace, ReactiveController(lim), slots=SLOTS, initial=2, seed=1)
    assert e.p(0.95) < r.p(0.95)
    assert e.p(0.99) <= lim.queue_budget_s
    peak_pool = 14 * trace.duration_s  # ceil(40 rps / (4 rps x 0.75)) replicas all along
    assert e.replica_seconds <= 0.6 * peak_pool
