"""The HTTP/3 response sink and request-stream record (:mod:`gateway.http.h3` is the adapter).

The sink reaches its connection through :class:`H3Output`, the two methods of
:class:`~gateway.http.h3.H3Protocol` it calls: that module imports this one, so this one does
not import it back.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from aioquic.h3.connection import ErrorCode, H3Connection
from aioquic.quic.connection import QuicConnection

from gateway.http.body_stream import BodyStream
from gateway.http.types import Call, Headers

__all__ = ["H3Sink", "H3Output", "H3Stream", "StreamGone", "unsent"]


class StreamGone(ConnectionError):
    """The client reset the stream or the connection closed while a response was being written."""


class H3Stream:
    """One request stream: what arrived, and the call and sink serving it."""

    __slots__ = ("sid", "headers", "body", "call", "sink", "early_bytes", "dispatched", "gone", "ended", "opened_at",
                 "body_stream")

    def __init__(self, sid: int, headers: Headers, now: float) -> None:
        self.sid = sid
        self.opened_at = now
        self.headers = headers
        self.body = bytearray()
        self.call: Call | None = None
        self.sink: H3Sink | None = None
        self.early_bytes = 0
        self.dispatched = False
        self.gone = False
        self.ended = False  # the response has been completed (or cut)
        self.body_stream: BodyStream | None = None  # the body, when the call reads it as it arrives


def unsent(quic: QuicConnection, sid: int) -> int:
    """Bytes written to a stream that the peer has not acknowledged yet.

    aioquic has no public per-stream buffer size: this reads the stream table and
    the sender's buffer (aioquic 1.x internals; the one place we do)."""
    stream = quic._streams.get(sid)
    return 0 if stream is None else len(stream.sender._buffer)


class H3Output(Protocol):
    """What an :class:`H3Sink` calls on its connection (:class:`~gateway.http.h3.H3Protocol`)."""

    def schedule_transmit(self) -> None:
        """Transmit once this loop iteration ends."""

    def wait_writable(self, sid: int) -> Awaitable[None]:
        """Done once stream ``sid``'s unacknowledged bytes are within the bound again."""


class H3Sink:
    """:class:`~gateway.http.types.ResponseSink` for one HTTP/3 request stream: it writes to
    ``h3`` over ``quic`` and holds a writer while more than ``bound`` bytes are unacknowledged."""

    __slots__ = ("_conn", "_st", "_head", "_h3", "_quic", "_bound")

    def __init__(self, conn: H3Output, h3: H3Connection, quic: QuicConnection, bound: int, st: H3Stream,
                 head: bool) -> None:
        self._conn = conn
        self._st = st
        self._head = head
        self._h3 = h3
        self._quic = quic
        self._bound = bound

    def _headers(self, status: int, headers: Headers, end: bool) -> None:
        self._h3.send_headers(self._st.sid, [(b":status", b"%d" % status), *headers], end_stream=end)

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        st = self._st
        if st.gone or st.ended:
            return
        st.ended = True
        if self._head:  # no content-length: aioquic's client checks it against the (empty) body
            self._headers(status, headers, True)
        elif not body:
            self._headers(status, [*headers, (b"content-length", b"0")], True)
        else:
            self._headers(status, [*headers, (b"content-length", b"%d" % len(body))], False)
            self._h3.send_data(st.sid, body, True)
        self._conn.schedule_transmit()

    def start(self, status: int, headers: Headers) -> None:
        if self._st.gone or self._st.ended:
            return
        self._headers(status, headers, False)
        self._conn.schedule_transmit()

    def send_nowait(self, data: bytes) -> bool:
        st = self._st
        if st.gone or unsent(self._quic, st.sid) > self._bound:
            return False
        if not self._head:
            self._h3.send_data(st.sid, data, False)
            self._conn.schedule_transmit()
        return True

    async def send(self, data: bytes) -> None:
        st = self._st
        while not st.gone and unsent(self._quic, st.sid) > self._bound:
            await self._conn.wait_writable(st.sid)
        if st.gone:
            raise StreamGone("the client went away")
        if not self._head:
            self._h3.send_data(st.sid, data, False)
            self._conn.schedule_transmit()

    def end(self, trailers: Headers | None = None) -> None:
        st = self._st
        if st.gone or st.ended:
            return
        st.ended = True
        if trailers:  # a trailing HEADERS frame ends the stream (RFC 9114 4.1)
            self._h3.send_headers(st.sid, trailers, end_stream=True)
        else:
            self._h3.send_data(st.sid, b"", True)
        self._conn.schedule_transmit()

    def abort(self) -> None:
        st = self._st
        if st.gone or st.ended:
            return
        st.ended = True
        self._quic.reset_stream(st.sid, ErrorCode.H3_INTERNAL_ERROR)
        self._conn.schedule_transmit()
