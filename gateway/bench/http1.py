"""The HTTP/1.1 client: keep-alive connections of our own over asyncio, parsed by httptools.

A request is rendered to bytes once before the run; sending it is one ``write``, and each
``recv`` of its response is one ``data_received`` whose time stamps every SSE event (or gRPC-Web message) in it.
Connections are pooled: a request takes an idle one or opens one (the connect is part of its
latency, as with any client pool). No task per request beyond the runner's own.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import Callable

import httptools

from .exchange import Exchange
from .records import BodyReader, Record, settled

__all__ = ["HTTP1Sender"]


class _Conn(asyncio.Protocol):
    """One keep-alive connection; :meth:`request` sends pre-rendered bytes and fills the record."""

    def __init__(self, exchange: Exchange, now: Callable[[], float]) -> None:
        self.exchange, self.now = exchange, now
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.fut: asyncio.Future[None] | None = None
        self.rec: Record | None = None
        self.reader: BodyReader | None = None
        self.keep_alive = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.fut is not None and not self.fut.done():
                self.fut.set_exception(ConnectionError(f"bad HTTP response: {e}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        assert self.rec is not None
        self.reader = self.exchange.reader(self.rec, self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        assert self.reader is not None
        self.reader.feed(body, self.now())

    def on_message_complete(self) -> None:
        t = self.now()
        assert self.reader is not None
        self.keep_alive = self.parser.should_keep_alive()
        self.reader.finish(t)
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(None)

    async def request(self, raw: bytes, rec: Record) -> None:
        self.rec, self.reader = rec, None
        self.fut = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(raw)
        try:
            await self.fut
        finally:
            self.fut = self.rec = self.reader = None


class HTTP1Sender:
    """Requests over HTTP/1.1 (``http://`` or ``https://``), keep-alive, pooled."""

    def __init__(self, url: str, exchange: Exchange, *, timeout: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None, now: Callable[[], float]) -> None:
        u = urllib.parse.urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.base_path = u.path.rstrip("/")
        self.exchange, self.timeout, self.now = exchange, timeout, now
        self.ssl = (ssl_context or ssl.create_default_context()) if self.tls else None
        fields = "".join(f"{k}: {v}\r\n" for k, v in exchange.headers)
        self._head = (f"POST {self.base_path}{exchange.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                      f"{fields}content-length: ").encode()
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()

    def prepare(self, body: bytes) -> bytes:
        return self._head + str(len(body)).encode() + b"\r\n\r\n" + body

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(self.exchange, self.now), self.host, self.port, ssl=self.ssl)
        self._all.add(conn)
        return conn

    async def send(self, payload: bytes, rec: Record) -> None:
        conn: _Conn | None = None
        with settled(rec, self.now, self.timeout):
            async with asyncio.timeout(self.timeout):
                while self._idle and self._idle[-1].closed:  # the server closed it while idle
                    self._all.discard(self._idle.pop())
                conn = self._idle.pop() if self._idle else await self._connect()
                await conn.request(payload, rec)
        if conn is not None:
            if rec.error in ("timeout", "connection") or not conn.keep_alive or conn.closed:
                self._drop(conn)
            else:
                self._idle.append(conn)

    def _drop(self, conn: _Conn) -> None:
        self._all.discard(conn)
        if conn.transport is not None:
            conn.transport.close()

    async def close(self) -> None:
        for conn in list(self._all):
            self._drop(conn)
        self._idle.clear()
