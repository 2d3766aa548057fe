"""A counting TCP relay for benchmarks: the bytes each direction carried, at the TCP payload level.

Clients connect to :attr:`CountingRelay.port`; each connection is spliced to ``target`` and every
byte is counted: :attr:`~CountingRelay.down` what the server sent (HTTP/2 frames of every kind:
HEADERS, DATA, trailers, SETTINGS, PING and WINDOW_UPDATE), :attr:`~CountingRelay.up` what the
clients sent. It is what any client library puts on the wire, even one whose I/O happens in C
(grpcio), so one figure compares protocols. No delay, no copies beyond the one write; reading
pauses when the other side's write buffer is full, so the server still sees its client's
back-pressure.
"""

from __future__ import annotations

import asyncio

__all__ = ["CountingRelay"]


class _Side(asyncio.Protocol):
    def __init__(self, relay: CountingRelay, downstream: bool) -> None:
        self.relay = relay
        self.downstream = downstream  # True: this side reads what the server sends
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.downstream:
            self.relay.down += len(data)
        else:
            self.relay.up += len(data)
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def eof_received(self) -> bool:
        if self.peer is not None and self.peer.transport is not None and self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class CountingRelay:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = 0
        self.down = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @classmethod
    async def start(cls, target: tuple[str, int]) -> CountingRelay:
        relay = cls(target)
        relay._server = await asyncio.get_running_loop().create_server(relay._front, "127.0.0.1", 0)
        relay.port = relay._server.sockets[0].getsockname()[1]
        return relay

    def _front(self) -> _Side:
        front = _Side(self, downstream=False)
        asyncio.get_running_loop().create_task(self._connect(front))
        return front

    async def _connect(self, front: _Side) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, back = await loop.create_connection(lambda: _Side(self, downstream=True), *self.target)
        except OSError:
            if front.transport is not None:
                front.transport.close()
            return
        assert back.transport is not None
        back.peer, front.peer = front, back
        for data in front.pending:
            back.transport.write(data)
        front.pending.clear()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
