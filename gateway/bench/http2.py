"""The HTTP/2 client: the ``h2`` library's sans-I/O core under our own asyncio protocol.

``https://`` negotiates h2 by ALPN; ``http://`` is h2c with prior knowledge. A few connections,
each carrying many requests as streams; a request takes the next connection in turn. Its HEADERS
and DATA are queued on the h2 core and the bytes go out once per loop iteration for every request
queued in it. A connection takes requests once the server's first SETTINGS is in (its stream
limit and windows are known from the start). Our receive windows are opened wide at the start (the h2 core acknowledges what
was read in large steps), so a long stream costs no WINDOW_UPDATE a frame. A request body larger
than the server's frame size or window is sent as the server's window allows; requests beyond
the server's concurrent-stream limit wait for a stream to end.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings

from .exchange import Exchange
from .records import BodyReader, Record, settled
from .turns import InTurn

__all__ = ["HTTP2Sender"]

_WINDOW = (1 << 31) - 1


@dataclass(slots=True)
class _Stream:
    rec: Record
    fut: asyncio.Future[None]
    body: bytes  # what is left to send
    reader: BodyReader | None = None


class _H2Conn(asyncio.Protocol):
    """One HTTP/2 connection; :meth:`request` queues a request and returns its future."""

    def __init__(self, exchange: Exchange, head: list[tuple[bytes, bytes]], now: Callable[[], float]) -> None:
        self.exchange, self.head, self.now = exchange, head, now
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, _Stream] = {}
        self.waiting: deque[_Stream] = deque()  # beyond the server's concurrent-stream limit
        self.sending: dict[int, _Stream] = {}  # bodies held back by flow control
        self.closed = False
        self.ready = asyncio.Event()  # the server's first SETTINGS (its stream limit and windows) is in
        self._flush: asyncio.Handle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        self.h2.local_settings = Settings(client=True, initial_values={
            SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW, SettingCodes.ENABLE_PUSH: 0,
            SettingCodes.MAX_HEADER_LIST_SIZE: H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(_WINDOW - 65_535)
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def _fail_all(self, exc: Exception) -> None:
        self.closed = True
        self.ready.set()
        for s in [*self.streams.values(), *self.waiting]:
            if not s.fut.done():
                s.fut.set_exception(exc)
        self.streams.clear()
        self.waiting.clear()
        self.sending.clear()

    def request(self, body: bytes, rec: Record) -> asyncio.Future[None]:
        fut = asyncio.get_running_loop().create_future()
        if self.closed:
            fut.set_exception(ConnectionError("the HTTP/2 connection is closed"))
            return fut
        self.waiting.append(_Stream(rec, fut, body))
        self._open_waiting()
        return fut

    def _open_waiting(self) -> None:
        limit = self.h2.remote_settings.max_concurrent_streams
        while self.waiting and self.h2.open_outbound_streams < limit:
            s = self.waiting.popleft()
            sid = self.h2.get_next_available_stream_id()
            self.h2.send_headers(sid, self.head + [(b"content-length", str(len(s.body)).encode())])
            self.streams[sid] = s
            self._send_body(sid, s)
        self._schedule()

    def _send_body(self, sid: int, s: _Stream) -> None:
        while s.body:
            n = min(len(s.body), self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if n <= 0:
                self.sending[sid] = s
                return
            self.h2.send_data(sid, s.body[:n])
            s.body = s.body[n:]
        self.h2.end_stream(sid)
        self.sending.pop(sid, None)

    def forget(self, rec: Record) -> None:
        """A request given up (its timeout): its stream is reset, what comes for it ignored."""
        for sid, s in list(self.streams.items()):
            if s.rec is rec:
                self._end(sid)
                if not self.closed:
                    self.h2.reset_stream(sid, 8)  # CANCEL
                    self._schedule()

    def _end(self, sid: int) -> _Stream | None:
        self.sending.pop(sid, None)
        return self.streams.pop(sid, None)

    def _schedule(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._flush = None
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except ProtocolError as e:
            self._fail_all(ConnectionError(f"bad HTTP/2 from the server: {e}"))
            if self.transport is not None:
                self.transport.close()
            return
        t = self.now()
        for ev in events:
            if isinstance(ev, DataReceived):
                s = self.streams.get(ev.stream_id)
                self.h2.acknowledge_received_data(ev.flow_controlled_length or 0, ev.stream_id)
                if s is not None and s.reader is not None and ev.data:
                    s.reader.feed(ev.data, t)
            elif isinstance(ev, ResponseReceived):
                s = self.streams.get(ev.stream_id)
                if s is not None and s.reader is None:
                    status = next((int(v) for k, v in ev.headers or () if k == b":status"), 0)
                    s.reader = self.exchange.reader(s.rec, status)
            elif isinstance(ev, StreamEnded):
                self._finish(ev.stream_id, t)
            elif isinstance(ev, StreamReset):
                s = self._end(ev.stream_id)
                if s is not None and not s.fut.done():
                    s.fut.set_exception(ConnectionError(f"stream reset by the server (code {ev.error_code})"))
            elif isinstance(ev, WindowUpdated):
                for sid, s in list(self.sending.items()):
                    self._send_body(sid, s)
            elif isinstance(ev, RemoteSettingsChanged):
                self.ready.set()
            elif isinstance(ev, ConnectionTerminated):
                self._fail_all(ConnectionError(f"GOAWAY from the server (code {ev.error_code})"))
        if self.waiting and not self.closed:
            self._open_waiting()
        self._send()

    def _finish(self, sid: int, t: float) -> None:
        s = self._end(sid)
        if s is None or s.fut.done():
            return
        if s.reader is None:
            s.fut.set_exception(ConnectionError("the response stream ended without headers"))
            return
        s.reader.finish(t)
        s.fut.set_result(None)


class HTTP2Sender:
    """Requests over HTTP/2: ``https://`` negotiates h2 by ALPN, ``http://`` is h2c."""

    def __init__(self, url: str, exchange: Exchange, *, timeout: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None, connections: int = 4,
                 now: Callable[[], float]) -> None:
        u = urllib.parse.urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        tls = u.scheme == "https"
        self.port = u.port or (443 if tls else 80)
        self.ssl: ssl.SSLContext | None = None
        if tls:
            self.ssl = ssl_context or ssl.create_default_context()
            self.ssl.set_alpn_protocols(["h2"])
        self.exchange, self.timeout, self.now = exchange, timeout, now
        self.head = exchange.head(u.scheme, f"{self.host}:{self.port}", u.path)
        self.pool: InTurn[_H2Conn] = InTurn(connections, self._connect)

    def prepare(self, body: bytes) -> bytes:
        return body

    async def _connect(self) -> _H2Conn:
        loop = asyncio.get_running_loop()
        transport, conn = await loop.create_connection(lambda: _H2Conn(self.exchange, self.head, self.now),
                                                       self.host, self.port, ssl=self.ssl)
        if self.ssl is not None and transport.get_extra_info("ssl_object").selected_alpn_protocol() != "h2":
            transport.close()
            raise ConnectionError("the server did not agree to HTTP/2 (ALPN)")
        await conn.ready.wait()
        return conn

    async def send(self, payload: bytes, rec: Record) -> None:
        conn: _H2Conn | None = None
        with settled(rec, self.now, self.timeout):
            async with asyncio.timeout(self.timeout):
                conn = await self.pool.take()
                await conn.request(payload, rec)
        if rec.error == "timeout" and conn is not None:
            conn.forget(rec)

    async def close(self) -> None:
        for conn in self.pool.conns:
            if conn.transport is not None:
                conn.transport.close()
        self.pool.conns.clear()
