"""The HTTP/3 client: aioquic's QUIC and H3 cores under our own asyncio protocol.

A few QUIC connections (``https://host:port``, UDP), each carrying many requests as streams;
a request takes the next connection in turn. Each request is its HEADERS and one DATA frame
queued on the H3 core; the datagrams go out once per loop iteration for all the requests
queued in it, and so do the ACKs for all the datagrams received in it (aioquic's own protocol
sends one a datagram: a streamed run cost 1.45x the client CPU a token). Every H3 event of a response is time-stamped as it is handed over: the pieces of
one datagram batch share (almost) one time, as the user would see them.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, cast

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from .exchange import Exchange
from .records import BodyReader, Record, settled
from .turns import InTurn

__all__ = ["HTTP3Sender"]


@dataclass(slots=True)
class _Pending:
    rec: Record
    fut: asyncio.Future[None]
    reader: BodyReader | None = None


class _H3Conn(QuicConnectionProtocol):
    """One QUIC connection speaking HTTP/3; :meth:`request` opens a stream and returns its future."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.pending: dict[int, _Pending] = {}
        self.exchange: Exchange | None = None
        self.now: Callable[[], float] = lambda: 0.0
        self.closed = False
        self._flush: asyncio.Handle | None = None

    def request(self, head: list[tuple[bytes, bytes]], body: bytes, rec: Record) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_exception(ConnectionError("the QUIC connection is closed"))
            return fut
        sid = self._quic.get_next_available_stream_id()
        self.h3.send_headers(sid, head)
        self.h3.send_data(sid, body, end_stream=True)
        self.pending[sid] = _Pending(rec, fut)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)
        return fut

    def forget(self, rec: Record) -> None:
        """A request given up (its timeout): its stream is reset, and what comes for it ignored."""
        for sid, p in list(self.pending.items()):
            if p.rec is rec:
                del self.pending[sid]
                if not self.closed:
                    self._quic.reset_stream(sid, 0x10C)  # H3_REQUEST_CANCELLED
                    self._send()

    def _send(self) -> None:
        self._flush = None
        self.transmit()

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        # As aioquic's, but what answers (ACKs above all) goes out once per loop turn for all the
        # datagrams received in it, not a datagram (and a system call) for each.
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        if self._flush is None:
            self._flush = self._loop.call_soon(self._send)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.closed = True
            why = event.reason_phrase or f"code {event.error_code}"
            for p in self.pending.values():
                if not p.fut.done():
                    p.fut.set_exception(ConnectionError(f"QUIC connection closed: {why}"))
            self.pending.clear()
            return
        if isinstance(event, StreamReset):
            reset = self.pending.pop(event.stream_id, None)
            if reset is not None and not reset.fut.done():
                reset.fut.set_exception(ConnectionError(f"stream reset by the server (code {event.error_code})"))
            return
        for ev in self.h3.handle_event(event):
            self._h3_event(ev)

    def _h3_event(self, ev: H3Event) -> None:
        if not isinstance(ev, (HeadersReceived, DataReceived)):
            return
        p = self.pending.get(ev.stream_id)
        if p is None:
            return
        t = self.now()
        if isinstance(ev, HeadersReceived):
            if p.reader is None:
                status = next((int(v) for k, v in ev.headers if k == b":status"), 0)
                assert self.exchange is not None
                p.reader = self.exchange.reader(p.rec, status)
        elif p.reader is not None:
            p.reader.feed(ev.data, t)
        if ev.stream_ended:
            del self.pending[ev.stream_id]
            if p.reader is None:
                p.fut.set_exception(ConnectionError("the response stream ended without headers"))
                return
            p.reader.finish(t)
            if not p.fut.done():
                p.fut.set_result(None)


def _quic_config(host: str, *, insecure: bool, cacert: str | None, idle_timeout: float) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=host, idle_timeout=idle_timeout)
    if insecure:
        config.verify_mode = ssl.CERT_NONE
    elif cacert:
        config.load_verify_locations(cafile=cacert)
    return config


class HTTP3Sender:
    """Requests over HTTP/3 (``https://host:port``: QUIC on that UDP port), over ``connections``."""

    def __init__(self, url: str, exchange: Exchange, *, timeout: float = 600.0, insecure: bool = False,
                 cacert: str | None = None, connections: int = 2, now: Callable[[], float]) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme != "https":
            raise ValueError("--protocol h3 takes an https:// URL (QUIC is always TLS)")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 443
        self.exchange, self.timeout, self.now = exchange, timeout, now
        self.insecure, self.cacert = insecure, cacert
        self.head = exchange.head("https", f"{self.host}:{self.port}", u.path)
        self._stack = AsyncExitStack()
        self.pool: InTurn[_H3Conn] = InTurn(connections, self._connect)

    def prepare(self, body: bytes) -> bytes:
        return body

    async def _connect(self) -> _H3Conn:
        cfg = _quic_config(self.host, insecure=self.insecure, cacert=self.cacert,
                           idle_timeout=max(60.0, self.timeout))
        conn = await self._stack.enter_async_context(
            connect(self.host, self.port, configuration=cfg, create_protocol=_H3Conn))
        assert isinstance(conn, _H3Conn)
        conn.exchange, conn.now = self.exchange, self.now
        return conn

    async def send(self, payload: bytes, rec: Record) -> None:
        conn: _H3Conn | None = None
        with settled(rec, self.now, self.timeout):
            async with asyncio.timeout(self.timeout):
                conn = await self.pool.take()
                await conn.request(self.head, payload, rec)
        if rec.error == "timeout" and conn is not None:
            conn.forget(rec)

    async def close(self) -> None:
        await self._stack.aclose()
        self.pool.conns.clear()
