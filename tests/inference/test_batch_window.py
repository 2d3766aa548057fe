"""Fixed and adaptive (DBS-Adapt) admission windows."""

from __future__ import annotations

import pytest

from inference.batch_window import AdaptiveWindow, FixedWindow, parse_batch_window


def test_fixed_window_waits_unless_batch_is_full() -> None:
    w = FixedWindow(0.01)
    assert w.admit_at(1.0, batch=1, full=4) == pytest.approx(1.01)
    assert w.admit_at(1.0, batch=4, full=4) == 1.0
    w.observe(5.0, 1.0)
    assert w.window == 0.01


def test_adaptive_window_follows_latency_error_scaled_by_load() -> None:
    w = AdaptiveWindow(0.05, initial=0.01, w_min=0.0, w_max=0.03, lr=0.5, quantile=0.5, clip=0.05)
    w.observe(0.03, load=1.0)  # 20 ms of head-room -> grow by lr * 0.02
    assert w.window == pytest.approx(0.02)
    w.observe(0.03, load=0.5)  # half the load, half the step
    assert w.window == pytest.approx(0.025)
    w.observe(0.0, load=1.0)
    assert w.window == 0.03  # clipped at w_max
    w.observe(0.06, load=0.0)  # idle: no drift
    assert w.window == 0.03
    w.observe(10.0, load=1.0)  # the error is clipped (here to 50 ms) per step
    assert w.window == pytest.approx(0.005)
    w.observe(10.0, load=1.0)
    assert w.window == 0.0  # clipped at w_min


def test_adaptive_window_tracks_a_latency_quantile() -> None:
    """Steps cost 2 ms + window x U(0, 2); target 10 ms as a p90. With a clip
    well below the latency noise each update is the pinball-loss gradient (a
    miss pulls 9x harder than head-room pushes), so about 10% of steps miss."""
    import random

    rng = random.Random(0)
    w = AdaptiveWindow(0.010, lr=0.5, w_max=0.05, quantile=0.9, clip=0.0002)
    misses = 0
    for i in range(20_000):
        latency = 0.002 + w.window * rng.uniform(0.0, 2.0)
        misses += i >= 10_000 and latency > 0.010
        w.observe(latency, load=1.0)
    assert 0.08 < misses / 10_000 < 0.12
    with pytest.raises(ValueError):
        AdaptiveWindow(0.01, quantile=1.0)


def test_parse_batch_window() -> None:
    assert isinstance(parse_batch_window("adaptive"), AdaptiveWindow)
    fixed = parse_batch_window("fixed:2.5")
    assert type(fixed) is FixedWindow and fixed.window == pytest.approx(0.0025)
    for bad in ("fixed:x", "sometimes", "fixed:-1"):
        with pytest.raises(ValueError):
            parse_batch_window(bad)
