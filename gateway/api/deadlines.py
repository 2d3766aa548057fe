"""Request deadlines without a timer per request.

How it works: generation calls :meth:`~DeadlineSweeper.add` themselves with
their deadline (a dict insert) and :meth:`~DeadlineSweeper.discard` themselves
when they end (a dict delete). One loop timer, armed only while something is
tracked, sweeps every ``interval`` seconds and calls ``expire()`` on overdue
calls. Deadlines are thus honoured to within ``interval``, which is fine for
request timeouts of seconds to minutes; a timer per request cost about as much
CPU as the rest of routing.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from .. import clock
from ..errors import APIError

__all__ = ["DeadlineSweeper", "Expirable"]


class Expirable(Protocol):
    def expire(self) -> None:
        """The deadline passed: end with a timeout (the sweeper has already forgotten it)."""
        ...

    def shut_down(self, err: APIError) -> None:
        """The gateway is stopping: end now with ``err``."""
        ...


class DeadlineSweeper:
    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self._deadlines: dict[Expirable, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._deadlines)

    def add(self, call: Expirable, timeout: float) -> None:
        self._deadlines[call] = clock.now() + timeout
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(min(self.interval, timeout), self._sweep)

    def discard(self, call: Expirable) -> None:
        self._deadlines.pop(call, None)

    def tracked(self) -> list[Expirable]:
        """Every call not yet ended (oldest first)."""
        return list(self._deadlines)

    def _sweep(self) -> None:
        self._timer = None
        now = clock.now()
        overdue = [c for c, d in self._deadlines.items() if d <= now]
        for c in overdue:
            del self._deadlines[c]
        for c in overdue:
            c.expire()
        if self._deadlines:
            next_due = min(self._deadlines.values()) - now
            self._timer = asyncio.get_running_loop().call_later(max(0.001, min(self.interval, next_due)),
                                                                self._sweep)
