"""TCP and Unix-socket channels: an asyncio Protocol feeding an :class:`Endpoint`.

Works with the default loop and with uvloop. TCP_NODELAY is set (frames are
already coalesced per loop iteration by the endpoint, so Nagle only adds
latency). When the peer stops reading and our transport's write buffer passes
its high-water mark we stop reading from the peer too, so a stuck peer cannot
make us queue replies without bound.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import cast

from .endpoint import Endpoint

__all__ = ["StreamChannel", "open_stream", "listen_stream"]

EndpointFactory = Callable[[], Endpoint]


class StreamChannel(asyncio.Protocol):
    """One TCP/Unix connection; bytes go to and from its endpoint."""

    def __init__(self, make_endpoint: EndpointFactory) -> None:
        self._make_endpoint = make_endpoint
        self.endpoint: Endpoint | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both have the methods used here.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform without NODELAY
                pass
        self.endpoint = self._make_endpoint()
        self.endpoint.attach(self)

    def data_received(self, data: bytes) -> None:
        assert self.endpoint is not None
        self.endpoint.data_received(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.endpoint is not None:
            self.endpoint.channel_lost(f"connection lost: {exc}" if exc else "peer closed the connection")

    def pause_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # ByteSink
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def open_stream(
    scheme: str, host: str, port: int, path: str, make_endpoint: EndpointFactory
) -> StreamChannel:
    """Connect a TCP (``scheme == "tcp"``) or Unix socket channel."""
    loop = asyncio.get_running_loop()
    if scheme == "unix":
        _, proto = await loop.create_unix_connection(lambda: StreamChannel(make_endpoint), path)
    else:
        _, proto = await loop.create_connection(lambda: StreamChannel(make_endpoint), host, port)
    return proto


async def listen_stream(
    scheme: str, host: str, port: int, path: str, make_endpoint: EndpointFactory
) -> tuple[asyncio.Server, str]:
    """Listen; return the server and the URL actually bound (port 0 resolved)."""
    loop = asyncio.get_running_loop()
    if scheme == "unix":
        server = await loop.create_unix_server(lambda: StreamChannel(make_endpoint), path)
        return server, f"unix://{path}"
    server = await loop.create_server(lambda: StreamChannel(make_endpoint), host, port)
    sockname = server.sockets[0].getsockname()
    bound_host = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
    return server, f"tcp://{bound_host}:{sockname[1]}"
