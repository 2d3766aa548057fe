"""The HTTP/2 client: httpx with h2, over TLS (ALPN) or cleartext with prior knowledge (h2c).

Requests are multiplexed on httpx's HTTP/2 connection(s) to the server; each piece of a
streamed body that httpx hands over is time-stamped as it arrives.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

import httpx

from .exchange import Exchange
from .records import Record, settled

__all__ = ["HTTP2Sender"]

_TIMEOUTS = (httpx.TimeoutException,)
_LOST = (httpx.TransportError, OSError)


class HTTP2Sender:
    """Requests over HTTP/2: ``https://`` negotiates h2 by ALPN, ``http://`` is h2c."""

    def __init__(self, url: str, exchange: Exchange, *, timeout: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None, connections: int = 4,
                 now: Callable[[], float]) -> None:
        self.url = url.rstrip("/") + exchange.path
        self.exchange, self.now = exchange, now
        self.headers = dict(exchange.headers)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.AsyncClient(http1=False, http2=True, verify=ssl_context or True, limits=limits,
                                        timeout=httpx.Timeout(timeout))
        self.timeout = timeout

    def prepare(self, body: bytes) -> bytes:
        return body

    async def send(self, payload: bytes, rec: Record) -> None:
        with settled(rec, self.now, self.timeout, timeouts=_TIMEOUTS, lost=_LOST):
            async with self.client.stream("POST", self.url, content=payload, headers=self.headers) as resp:
                reader = self.exchange.reader(rec, resp.status_code)
                async for chunk in resp.aiter_raw():
                    reader.feed(chunk, self.now())
                reader.finish(self.now())

    async def close(self) -> None:
        await self.client.aclose()
