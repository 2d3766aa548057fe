"""Listeners: ``start_server`` binds one TCP port serving HTTP/1.1 + h2c prior
knowledge (cleartext) or HTTP/1.1 + h2 via ALPN (TLS), and returns a handle
for draining and shutdown.

Each connection starts as :class:`~gateway.http.h1.H1Protocol`, which hands
itself over to :class:`~gateway.http.h2.H2Protocol` when the first bytes are
the HTTP/2 preface or TLS negotiated ``h2``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from gateway.http.common import EventHook, HttpLimits, ProtocolEvent, ServerState
from gateway.http.h1 import H1Protocol
from gateway.http.types import Handler

__all__ = ["HttpLimits", "HttpServer", "ProtocolEvent", "start_server"]


class HttpServer:
    """A running listener. Create with :func:`start_server`."""

    def __init__(self, server: asyncio.Server, state: ServerState, tls: bool) -> None:
        self._server = server
        self._state = state
        self.tls = tls
        sock = server.sockets[0]
        self.host: str = sock.getsockname()[0]
        self.port: int = sock.getsockname()[1]

    @property
    def in_flight(self) -> int:
        """Requests whose handler is running now."""
        return self._state.in_flight

    @property
    def connections(self) -> int:
        return len(self._state.connections)

    def stop_accepting(self) -> None:
        """Close the listening socket; idle keep-alive connections close now,
        busy ones after their current response (h1 ``connection: close``, h2 GOAWAY)."""
        if self._state.draining:
            return
        self._state.draining = True
        self._server.close()
        for conn in list(self._state.connections):
            conn.drain()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._state.wait_idle(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop accepting and drop every connection (running handlers are cancelled)."""
        self.stop_accepting()
        for conn in list(self._state.connections):
            conn.abort()
        # let cancelled handler tasks run their finally blocks (bounded: a
        # handler that swallows cancellation must not hang shutdown)
        await self.wait_idle(1.0)
        await self._server.wait_closed()


async def start_server(
    handler: Handler,
    *,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    limits: HttpLimits | None = None,
    on_event: EventHook | None = None,
    reuse_port: bool = False,
    backlog: int = 1024,
) -> HttpServer:
    """Bind ``host:port`` (0 picks a free port) and serve ``handler`` on it."""
    state = ServerState(handler, limits or HttpLimits(), on_event)
    tls = ssl_context is not None

    def factory() -> asyncio.Protocol:
        return H1Protocol(state, tls=tls)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        factory,
        host=host,
        port=port,
        ssl=ssl_context,
        reuse_port=reuse_port or None,
        backlog=backlog,
        ssl_handshake_timeout=state.limits.header_timeout if tls else None,
    )
    for sock in server.sockets:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return HttpServer(server, state, tls)
