"""TCP and Unix-socket channels: an asyncio Protocol feeding an :class:`Endpoint`.

Works with the default loop and with uvloop (:class:`~transport.channel.ChannelBase`:
TCP_NODELAY, back-pressure). With ``tls`` (a session factory) the channel is a
:class:`~transport.tls_channel.TlsChannel` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .channel import ChannelBase
from .endpoint import Endpoint
from .tls import TlsSession
from .tls_channel import TlsChannel

__all__ = ["StreamChannel", "open_stream", "listen_stream", "SessionFactory"]

EndpointFactory = Callable[[], Endpoint]
SessionFactory = Callable[[], TlsSession]


class StreamChannel(ChannelBase):
    """One TCP/Unix connection; bytes go to and from its endpoint."""

    def __init__(self, make_endpoint: EndpointFactory) -> None:
        self._make_endpoint = make_endpoint
        self.endpoint: Endpoint | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = self._connected(transport)
        self.endpoint = self._make_endpoint()
        self.endpoint.peer = peer
        self.endpoint.attach(self)

    def data_received(self, data: bytes) -> None:
        assert self.endpoint is not None
        self.endpoint.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.endpoint is not None:
            self.endpoint.channel_lost(f"connection lost: {exc}" if exc else "peer closed the connection")

    # ByteSink
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _channel(make_endpoint: EndpointFactory, tls: SessionFactory | None, server_side: bool
             ) -> Callable[[], asyncio.Protocol]:
    if tls is None:
        return lambda: StreamChannel(make_endpoint)
    return lambda: TlsChannel(make_endpoint, tls, server_side)


async def open_stream(
    scheme: str, host: str, port: int, path: str, make_endpoint: EndpointFactory, tls: SessionFactory | None = None
) -> asyncio.BaseProtocol:
    """Connect a TCP (``scheme == "tcp"``) or Unix socket channel (over TLS with ``tls``)."""
    loop = asyncio.get_running_loop()
    channel = _channel(make_endpoint, tls, server_side=False)
    if scheme == "unix":
        _, proto = await loop.create_unix_connection(channel, path)
    else:
        _, proto = await loop.create_connection(channel, host, port)
    return proto


async def listen_stream(
    scheme: str, host: str, port: int, path: str, make_endpoint: EndpointFactory, tls: SessionFactory | None = None
) -> tuple[asyncio.Server, str]:
    """Listen (over TLS with ``tls``); return the server and the URL actually bound (port 0 resolved)."""
    loop = asyncio.get_running_loop()
    channel = _channel(make_endpoint, tls, server_side=True)
    if scheme == "unix":
        server = await loop.create_unix_server(channel, path)
        return server, f"unix://{path}"
    server = await loop.create_server(channel, host, port)
    sockname = server.sockets[0].getsockname()
    bound_host = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
    return server, f"tcp://{bound_host}:{sockname[1]}"
