"""What every socket channel shares (plain and TLS): TCP_NODELAY, back-pressure, the peer's name.

TCP_NODELAY is set: frames are already coalesced per loop iteration by the endpoint,
so Nagle only adds latency. When the peer stops reading and our transport's write
buffer passes its high-water mark we stop reading from the peer too, so a stuck
peer cannot make us queue replies without bound.
"""

from __future__ import annotations

import asyncio
import socket
from typing import cast

__all__ = ["ChannelBase", "peer_name"]


def peer_name(transport: asyncio.BaseTransport) -> str:
    """``host:port`` of the peer (``unix`` for a Unix socket)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = f"[{peer[0]}]" if ":" in str(peer[0]) else str(peer[0])
        return f"{host}:{peer[1]}"
    return "unix"


class ChannelBase(asyncio.Protocol):
    """The socket side of a channel; subclasses move the bytes."""

    transport: asyncio.Transport | None = None

    def _connected(self, transport: asyncio.BaseTransport) -> str:
        """Keep the transport, set TCP_NODELAY; return the peer's name."""
        # uvloop's transports are not asyncio.Transport subclasses; both have the methods used here.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform without NODELAY
                pass
        return peer_name(transport)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def pause_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
