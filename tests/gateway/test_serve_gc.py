"""``gateway.serve.tune_gc``: the gateway process's garbage-collector settings."""

from __future__ import annotations

import gc

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
