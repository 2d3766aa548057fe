"""``start_server``: one TCP port (cleartext, or TLS with ``ssl_context``) as a
:class:`~gateway.http.listeners.StreamListener`; see :mod:`gateway.http.listeners`."""

from __future__ import annotations

import ssl

from gateway.http.common import EventHook, HttpLimits, ProtocolEvent
from gateway.http.listeners import ListenerSpec, StreamListener, start_listener
from gateway.http.types import Entrance

__all__ = ["HttpLimits", "HttpServer", "ProtocolEvent", "start_server"]

HttpServer = StreamListener


async def start_server(
    entrance: Entrance,
    *,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None = None,
    limits: HttpLimits | None = None,
    on_event: EventHook | None = None,
    reuse_port: bool = False,
    backlog: int = 1024,
) -> StreamListener:
    """Bind ``host:port`` (0 picks a free port) and serve ``entrance`` on it."""
    spec = ListenerSpec(
        "tls" if ssl_context is not None else "tcp",
        host,
        port,
        ssl=ssl_context,
        reuse_port=reuse_port,
        backlog=backlog,
    )
    return await start_listener(entrance, spec, limits=limits, on_event=on_event)
