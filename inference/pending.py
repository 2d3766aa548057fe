"""Work a worker holds for a request before the request joins the engine (a structured-output grammar
compiling, a prompt pass running): one future per (connection id, request id), ended by its own
completion, a cancel, or its connection going away."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

__all__ = ["Key", "PendingWork"]

Key = tuple[int, int]  # (connection id, request id)
T = TypeVar("T")


class PendingWork(Generic[T]):
    """The futures of requests not yet in the engine, by key."""

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: dict[Key, asyncio.Future[T]] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def add(self, key: Key, fut: asyncio.Future[T]) -> None:
        self._futures[key] = fut

    def take(self, key: Key, fut: object) -> bool:
        """Whether ``fut`` (done) is still ``key``'s, which is then forgotten; False when the request
        was cancelled or its connection went away meanwhile."""
        if self._futures.get(key) is not fut:
            return False
        del self._futures[key]
        return True

    def cancel(self, key: Key) -> bool:
        """Drop a request whose work is still pending; False if it has none."""
        fut = self._futures.pop(key, None)
        if fut is None:
            return False
        fut.cancel()
        return True

    def forget(self, cid: int) -> None:
        """A connection went away: drop its requests' pending work."""
        for key in [k for k in self._futures if k[0] == cid]:
            self._futures.pop(key).cancel()
