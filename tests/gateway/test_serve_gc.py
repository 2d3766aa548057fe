"""``gateway.serve.tune_gc`` and ``gateway.gc_sweep``: the gateway process's garbage-collector policy."""

from __future__ import annotations

import gc

from gateway.gc_sweep import CycleSweeper
from gateway.serve import GC_GEN0_THRESHOLD, tune_gc


def test_tune_gc_freezes_startup_objects_and_raises_gen0_threshold() -> None:
    before = gc.get_threshold()
    try:
        gc.unfreeze()
        startup = [[i] for i in range(10)]  # GC-tracked objects alive at "start-up"
        tune_gc()
        assert gc.get_freeze_count() >= len(startup)
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, before[1], before[2])
        tune_gc(1234)
        assert gc.get_threshold()[0] == 1234
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_cycle_sweeper_collects_when_objects_outlived_refcounting_within_its_budget() -> None:
    """Counts as gc.get_count() gives them. A collection that finds little garbage and takes
    50 ms at a 1% budget spaces the next by 5 s; one that takes 1 ms, or one that finds
    garbage (freeing it costs the same whenever it happens), by the 1 s interval."""
    counts = [(10, 0, 0)]
    clock = [100.0]
    took = [0.05]
    found = [7]

    def collect() -> int:
        clock[0] += took[0]
        counts[0] = (0, 0, 0)
        return found[0]

    sw = CycleSweeper(interval=1.0, budget=0.01, min_growth=1000, collect=collect, counts=lambda: counts[0],
                      clock=lambda: clock[0])  # fmt: skip
    assert not sw.due(100.0)  # idle: a few allocations, nothing promoted
    counts[0] = (1500, 0, 0)  # garbage cycles waiting in generation 0
    assert sw.due(100.0)
    sw.sweep()
    assert (sw.sweeps, sw.collected) == (1, 7) and not sw.due(clock[0])
    counts[0] = (3, 1, 0)  # a young collection promoted objects
    assert not sw.due(104.9) and sw.due(105.0)  # 50 ms / 1% = 5 s after the last start
    clock[0] = 105.0
    took[0] = 0.001
    sw.sweep()
    counts[0] = (0, 0, 1)
    assert not sw.due(105.9) and sw.due(106.0)  # a cheap collection: the interval bounds it
    clock[0], took[0], found[0] = 106.0, 0.15, 52_000
    sw.sweep()
    counts[0] = (1200, 0, 0)
    assert sw.due(107.0) and sw.collected == 52_014  # 150 ms, but it freed a burst's garbage
