"""Multiplexed connections (HTTP/2, HTTP/3) taken in turn by requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Multiplexed", "InTurn"]


class Multiplexed(Protocol):
    closed: bool


C = TypeVar("C", bound=Multiplexed)


class InTurn(Generic[C]):
    """``n`` connections, each opened when first taken and again when taken closed."""

    def __init__(self, n: int, connect: Callable[[], Awaitable[C]]) -> None:
        self.n, self.connect = max(1, n), connect
        self.conns: list[C] = []
        self.turn = 0
        self._lock = asyncio.Lock()

    async def take(self) -> C:
        self.turn += 1
        i = self.turn % self.n
        if i < len(self.conns) and not self.conns[i].closed:
            return self.conns[i]
        async with self._lock:  # one connect at a time: concurrent requests share it
            if i < len(self.conns) and not self.conns[i].closed:
                return self.conns[i]
            conn = await self.connect()
            if i < len(self.conns):
                self.conns[i] = conn
            else:
                self.conns.append(conn)
            return conn
