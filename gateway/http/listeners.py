"""Listeners: where connections come from. A :class:`ListenerSpec` names one (TCP
cleartext: HTTP/1.1 + h2c prior knowledge; TLS: HTTP/1.1 + h2 by ALPN; a Unix domain
socket: HTTP/1.1 + h2c), :func:`start_listener` binds it and returns a :class:`Listener`
for draining and shutdown. ``serve.py`` starts whichever the settings name; a UDP/QUIC
listener for HTTP/3 implements the same :class:`Listener` protocol beside them.

Each stream connection starts as :class:`~gateway.http.h1.H1Protocol`, which hands itself
over to :class:`~gateway.http.h2.H2Protocol` when the first bytes are the HTTP/2 preface
or TLS negotiated ``h2``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.http.common import EventHook, HttpLimits, ServerState
from gateway.http.h1 import H1Protocol
from gateway.http.types import Entrance, StreamsBody
from gateway.multiproc import inherited

__all__ = ["ListenerSpec", "Listener", "StreamListener", "start_listener"]


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """What to listen on."""

    kind: Literal["tcp", "tls", "unix"]
    host: str = "127.0.0.1"  # tcp, tls
    port: int = 0  # tcp, tls; 0 picks a free port
    path: str = ""  # unix: the socket file
    ssl: ssl.SSLContext | None = None  # tls: with ALPN h2, http/1.1 (gateway.http.tls)
    reuse_port: bool = False  # tcp, tls: SO_REUSEPORT, one gateway process per core
    backlog: int = 1024
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()  # on every response (TLS: Alt-Svc for HTTP/3)

    def __post_init__(self) -> None:
        if (self.kind == "tls") != (self.ssl is not None):
            raise ValueError("ListenerSpec: an ssl context goes with kind 'tls', and only with it")
        if (self.kind == "unix") != bool(self.path):
            raise ValueError("ListenerSpec: a path goes with kind 'unix', and only with it")


class Listener(Protocol):
    """A bound listener (TCP, TLS, Unix; UDP/QUIC next) and the requests it has in flight."""

    @property
    def address(self) -> tuple[str, int] | str:
        """Where it listens: (host, port) as bound (port 0 resolved), or a socket path."""
        ...

    @property
    def url(self) -> str:
        """How a client names it (``http://host:port``, ``https://…``, ``unix:path``)."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests handed to the entrance whose ``done()`` has not come yet."""
        ...

    def stop_accepting(self) -> None:
        """Accept nothing new; idle connections close now, busy ones after their response."""
        ...

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` passed first."""
        ...

    async def close(self) -> None:
        """Stop accepting and drop every connection (running calls are cancelled)."""
        ...


class StreamListener:
    """A listening stream socket (TCP, TLS or Unix). Create with :func:`start_listener`."""

    def __init__(self, spec: ListenerSpec, server: asyncio.Server, state: ServerState, *,
                 owns_path: bool = True) -> None:
        self.spec = spec
        self._owns_path = owns_path  # an inherited Unix socket's file is the supervisor's to remove
        self._server = server
        self._state = state
        name = server.sockets[0].getsockname()
        self.address: tuple[str, int] | str = (
            (str(name[0]), int(name[1])) if spec.kind != "unix" else spec.path
        )

    @property
    def tls(self) -> bool:
        return self.spec.kind == "tls"

    @property
    def host(self) -> str:
        return self.address[0] if isinstance(self.address, tuple) else ""

    @property
    def port(self) -> int:
        """The bound TCP port (0 for a Unix socket)."""
        return self.address[1] if isinstance(self.address, tuple) else 0

    @property
    def url(self) -> str:
        """``http://host:port``, ``https://host:port`` or ``unix:path``."""
        if not isinstance(self.address, tuple):
            return f"unix:{self.address}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def in_flight(self) -> int:
        return self._state.in_flight

    @property
    def connections(self) -> int:
        return len(self._state.connections)

    def stop_accepting(self) -> None:
        if self._state.draining:
            return
        self._state.draining = True
        self._server.close()
        for conn in list(self._state.connections):
            conn.drain()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._state.wait_idle(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self.stop_accepting()
        for conn in list(self._state.connections):
            conn.abort()
        # let cancelled calls run their finally blocks (bounded: one that swallows
        # cancellation must not hang shutdown)
        await self.wait_idle(1.0)
        await self._server.wait_closed()
        if self.spec.kind == "unix" and self._owns_path:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(self.spec.path).st_mode):
                    os.unlink(self.spec.path)


async def start_listener(
    entrance: Entrance,
    spec: ListenerSpec,
    *,
    limits: HttpLimits | None = None,
    on_event: EventHook | None = None,
    streams_body: StreamsBody | None = None,
) -> StreamListener:
    """Bind ``spec`` and serve every request it accepts through ``entrance`` (``streams_body``:
    the requests whose body the entrance reads as it arrives, over HTTP/2)."""
    state = ServerState(entrance, limits or HttpLimits(), on_event, list(spec.extra_headers), streams_body)
    tls = spec.kind == "tls"

    def factory() -> asyncio.Protocol:
        return H1Protocol(state, tls=tls)

    loop = asyncio.get_running_loop()
    # a gateway process of several (gateway/multiproc) serves the socket its supervisor bound
    sock = inherited.take("unix", spec.path) if spec.kind == "unix" else inherited.take("tcp", spec.port)
    if spec.kind == "unix":
        server = await (loop.create_unix_server(factory, sock=sock, backlog=spec.backlog) if sock is not None
                        else loop.create_unix_server(factory, spec.path, backlog=spec.backlog))
    elif sock is not None:
        server = await loop.create_server(factory, sock=sock, ssl=spec.ssl, backlog=spec.backlog,
                                          ssl_handshake_timeout=state.limits.header_timeout if tls else None)
    else:
        server = await loop.create_server(
            factory,
            host=spec.host,
            port=spec.port,
            ssl=spec.ssl,
            reuse_port=spec.reuse_port or None,
            backlog=spec.backlog,
            ssl_handshake_timeout=state.limits.header_timeout if tls else None,
        )
        for sock in server.sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return StreamListener(spec, server, state, owns_path=sock is None)
