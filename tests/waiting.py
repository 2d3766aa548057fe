"""Waiting in tests for something another task or process does: poll a condition, bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["wait_for"]


async def wait_for(cond: Callable[[], object], timeout: float = 2.0, interval: float = 0.005) -> None:
    """Run the loop until ``cond()`` is true; AssertionError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
