"""What every HTTP/3 connection of one QUIC listener shares: the entrance, settings,
in-flight count for draining, and the early-data policy."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Protocol

from gateway.http.common import EventHook, ProtocolEvent
from gateway.http.quic_settings import QuicSettings, early_data_safe
from gateway.http.types import Entrance, StreamsBody

__all__ = ["H3ServerState", "LiveConnection"]

log = logging.getLogger("gateway.http.h3")


class LiveConnection(Protocol):
    def drain(self) -> None: ...
    def abort(self) -> None: ...
    def expire_requests(self, now: float) -> None: ...


class H3ServerState:
    """Listener-wide bookkeeping (one per :func:`~gateway.http.quic_listener.start_quic_listener`)."""

    def __init__(self, entrance: Entrance, settings: QuicSettings, on_event: EventHook | None = None,
                 streams_body: StreamsBody | None = None) -> None:
        self.entrance = entrance
        self.streams_body = streams_body  # requests whose body the entrance reads as it arrives
        self.settings = settings
        self.on_event = on_event
        self.connections: set[LiveConnection] = set()
        self.in_flight = 0
        self.draining = False
        self.early_served = 0  # requests run from 0-RTT data
        self.early_refused = 0  # requests in 0-RTT data answered 425
        self._routes = tuple(settings.early_data_routes)
        self._idle: list[asyncio.Future[None]] = []

    def early_allowed(self, method: str, path: str, early_bytes: int) -> bool:
        """May a request that arrived in 0-RTT run now (RFC 8470)? Otherwise: 425."""
        s = self.settings
        return (s.replay_protection and early_bytes <= s.max_early_data
                and early_data_safe(self._routes, method, path))

    def report(self, status: int, reason: str) -> None:
        """A request answered by the adapter (400/408/413/431/425), for the metrics hook."""
        if self.on_event is not None:
            try:
                self.on_event(ProtocolEvent(status, "h3", reason))
            except Exception:  # a metrics hook must never break serving
                log.exception("on_event hook failed")

    @staticmethod
    def decode_path(raw: bytes) -> str:
        """Percent-decoded path; raises ``UnicodeDecodeError`` on bad UTF-8."""
        if b"%" in raw:
            raw = urllib.parse.unquote_to_bytes(raw)
        return raw.decode("utf-8")

    def request_started(self) -> None:
        self.in_flight += 1

    def request_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            for fut in self._idle:
                if not fut.done():
                    fut.set_result(None)
            self._idle.clear()

    async def wait_idle(self) -> None:
        if self.in_flight:
            fut = asyncio.get_running_loop().create_future()
            self._idle.append(fut)
            await fut
