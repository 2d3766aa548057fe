"""A full cyclic collection now and then, so a burst's garbage cycles do not outlive it.

Why: :func:`gateway.serve.tune_gc` collects generation 0 only every 20,000 net
allocations, to save the CPU the default threshold spent. Objects that are
alive at such a collection (every open connection's, under a burst) move to the
older generations, and those are collected only after 10 and 100 young
collections. A connection's objects that form a reference cycle (an httptools
parser holds bound methods of its connection; an ``h2`` connection holds a table
of its own bound methods) then wait there long after the connection closed:
measured, 15 bursts of 2,000 one-request connections grew the gateway's RSS
44.6 -> 116.1 MB, ~1.6 KB per request, and none of it came back while idle.

How it works: every ``interval`` seconds :meth:`CycleSweeper.due` asks whether
objects outlived refcounting since the last full collection (``gc.get_count()``:
``min_growth`` net tracked allocations in generation 0, or a young collection
that promoted some) and whether the budget allows another; :meth:`sweep` runs
``gc.collect()``. One that found garbage allows the next after ``interval``
(freeing it costs the same whenever it happens, and a pile left to grow makes
one long pause); one that found little, having walked live objects for
nothing, spaces the next by its cost, so such collections take at most
``budget`` of the process's time. Idle, the counts stand still and nothing
runs. Clock and collector are arguments.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from .clock import now as clock_now

__all__ = ["CycleSweeper"]


class CycleSweeper:
    """Runs ``gc.collect()`` when objects outlived refcounting since the last one, within a time budget."""

    def __init__(
        self,
        *,
        interval: float = 1.0,
        budget: float = 0.01,
        min_growth: int = 1000,
        collect: Callable[[], int] = gc.collect,
        counts: Callable[[], tuple[int, int, int]] = gc.get_count,
        clock: Callable[[], float] = clock_now,
    ) -> None:
        self.interval = interval
        self.budget = budget
        self.min_growth = min_growth
        self._collect = collect
        self._counts = counts
        self._clock = clock
        self._next = 0.0  # no full collection before this time
        self.sweeps = 0
        self.collected = 0

    def due(self, now: float) -> bool:
        new, young, old = self._counts()
        return (new >= self.min_growth or young > 0 or old > 0) and now >= self._next

    def sweep(self) -> None:
        start = self._clock()
        found = self._collect()
        took = self._clock() - start
        self.sweeps += 1
        self.collected += found
        # Freeing garbage costs the same whenever it happens; walking live objects for nothing is
        # the waste to bound. A sweep that found garbage allows the next after ``interval``, and
        # one that found little spaces the next by its cost.
        spacing = self.interval if found >= self.min_growth else max(self.interval, took / self.budget)
        self._next = start + spacing

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            if self.due(self._clock()):
                self.sweep()
