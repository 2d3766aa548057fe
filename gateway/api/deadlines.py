"""Request deadlines without a timer per request.

How it works: handlers :meth:`~DeadlineSweeper.add` their task with its
deadline (a dict insert) and :meth:`~DeadlineSweeper.discard` it when done (a
dict delete). One loop timer, armed only while something is tracked, sweeps
every ``interval`` seconds and cancels overdue tasks, remembering them so the
handler can tell "timed out" (-> 504) from "client went away". Deadlines are
thus honoured to within ``interval``, which is fine for request timeouts of
seconds to minutes; ``asyncio.timeout`` per request cost about as much CPU
as the rest of routing.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["DeadlineSweeper"]


class DeadlineSweeper:
    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self._deadlines: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._deadlines)

    def add(self, task: asyncio.Task[object], timeout: float) -> None:
        self._deadlines[task] = time.monotonic() + timeout
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(min(self.interval, timeout), self._sweep)

    def discard(self, task: asyncio.Task[object]) -> None:
        self._deadlines.pop(task, None)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """True (once) if the sweeper cancelled ``task``; the cancellation is then undone."""
        if task in self._expired:
            self._expired.discard(task)
            task.uncancel()
            return True
        return False

    def _sweep(self) -> None:
        self._timer = None
        now = time.monotonic()
        overdue = [t for t, d in self._deadlines.items() if d <= now]
        for t in overdue:
            del self._deadlines[t]
            if not t.done():
                self._expired.add(t)
                t.cancel()
        if self._deadlines:
            next_due = min(self._deadlines.values()) - now
            self._timer = asyncio.get_running_loop().call_later(max(0.001, min(self.interval, next_due)),
                                                                self._sweep)
