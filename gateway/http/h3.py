"""HTTP/3 adapter: aioquic's QUIC + H3 connection into the one pipeline.

How it works: aioquic's asyncio protocol feeds each datagram to the
:class:`~aioquic.quic.connection.QuicConnection`, hands us its events
(:meth:`H3Protocol.quic_event_received`) and transmits. We pass them through
:class:`~aioquic.h3.connection.H3Connection`; a request stream collects its
headers and body and, once the client ends it, becomes a
:class:`~gateway.http.types.Request` for the entrance with an :class:`~gateway.http.h3_sink.H3Sink`.
The sink writes into aioquic's per-stream send buffers (which QUIC flow control
and congestion control drain) and asks for one transmit per loop iteration, so
the tokens every stream got in one engine step leave together, in as few packets
as fit. A request the server state's ``streams_body`` picks goes to the entrance at its
headers instead, its body a :class:`~gateway.http.body_stream.BodyStream` fed as DATA
arrives (bounded by the body limit: aioquic credits QUIC flow control itself); once the
call has answered, the rest of the upload is refused with STOP_SENDING (H3_NO_ERROR).

Early data (RFC 8470, RFC 9001 9.2). What aioquic gives us, and what we rely on:

* stream data arrives through the same events whether it came in 0-RTT or
  1-RTT packets; the event does not say which. But aioquic's server can only
  decrypt the client's 1-RTT packets once it has the client's Finished, which
  also raises ``HandshakeCompleted``. So a request that is complete before that
  event was sent (entirely) in early data, and only such a request can be run
  by a replay: an attacker replaying the client's first flight cannot complete
  the handshake. We decide at dispatch: ``early = not handshake complete``.
* the server's 0-RTT acceptance is ``HandshakeCompleted.early_data_accepted``
  (and ``session_resumed``); on the client the same event says whether its
  0-RTT was accepted. aioquic accepts 0-RTT whenever a ticket resumes, so
  one-use 0-RTT is made by the ticket fetcher (:mod:`gateway.http.quic_tickets`).
* ``max_early_data`` cannot be given to aioquic (QUIC fixes the TLS
  ``max_early_data_size`` at 0xffffffff; the amount is bounded by the
  transport parameters the ticket remembers), so the budget is applied here:
  request bytes received before the handshake completed, per connection.

Three aioquic internals are read or set, each where it is used (setup.cfg pins
aioquic below 2): the peer's stream limit (``_local_max_streams_bidi``, no
setting for it), a stream's unacknowledged bytes (``_streams[sid].sender``, no
public size) and, in the listener, the server's connection table (``_protocols``,
to ignore new connections while draining).

An early request is answered ``425 Too Early`` unless replay protection is on,
its route is listed as safe for early data and the connection is within its
budget; the client repeats it after the handshake (RFC 8470 5.2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from gateway.errors import APIError, render_http
from gateway.http.body_stream import BodyStream
from gateway.http.h3_sink import H3Sink, H3Stream, StreamGone, unsent
from gateway.http.h3_state import H3ServerState
from gateway.http.types import Headers, Request

__all__ = ["H3Protocol", "StreamGone"]

log = logging.getLogger("gateway.http.h3")


class H3Protocol(QuicConnectionProtocol):
    """One QUIC connection serving HTTP/3 requests."""

    def __init__(self, quic: QuicConnection, stream_handler: Any = None, *, state: H3ServerState) -> None:
        super().__init__(quic, stream_handler)
        self.state = state
        # aioquic 1.x fixes the concurrent bidirectional streams a peer may open at 128 and
        # has no setting for it; the limit is read when the transport parameters are sent.
        # (``sent`` too: it is what the peer was told, which MAX_STREAMS updates are measured from)
        limit = quic._local_max_streams_bidi
        limit.value = limit.sent = state.settings.max_streams
        self._h3: H3Connection | None = None
        self._streams: dict[int, H3Stream] = {}
        self._handshake_done = False
        self._early_bytes = 0
        self._transmit_handle: asyncio.Handle | None = None
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._draining = False
        self._closing = False
        self._flushing: set[int] = set()  # ended responses whose bytes are not all acknowledged yet
        self.early_data_accepted = False
        self.session_resumed = False
        state.connections.add(self)

    # -- feed, process events, transmit ----------------------------------------------------
    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic's own protocol transmits after every datagram; the datagrams one poll
        # returned (a burst of acks) share one transmit at the end of this loop iteration
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        self.schedule_transmit()

    def transmit(self) -> None:
        self._transmit_handle = None
        super().transmit()
        if self._waiters:  # acknowledgements and sends free send buffers
            bound = self.state.settings.max_stream_buffer
            for sid, fut in list(self._waiters.items()):
                if unsent(self._quic, sid) <= bound:
                    del self._waiters[sid]
                    if not fut.done():
                        fut.set_result(None)
        if self._draining:
            self._close_when_flushed()

    def schedule_transmit(self) -> None:
        """Transmit once this loop iteration ends: every write of one step goes in one pass."""
        if self._transmit_handle is None:
            self._transmit_handle = self._loop.call_soon(self.transmit)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            if event.alpn_protocol in H3_ALPN:
                self._h3 = H3Connection(self._quic)
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
            self.early_data_accepted = event.early_data_accepted
            self.session_resumed = event.session_resumed
        elif isinstance(event, (StreamReset, StopSendingReceived)):
            self._client_gone(event.stream_id)
        elif isinstance(event, ConnectionTerminated):
            self._terminated()
            return
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event(h3_event)

    # -- requests ---------------------------------------------------------------------------
    def _h3_event(self, ev: H3Event) -> None:
        if isinstance(ev, HeadersReceived):
            st = self._streams.get(ev.stream_id)
            if st is not None:  # trailers: nothing we serve reads them, but they may end a streamed body
                if ev.stream_ended and st.body_stream is not None:
                    st.body_stream.end()
                return
            st = self._streams[ev.stream_id] = H3Stream(ev.stream_id, ev.headers, self._loop.time())
            size = sum(len(k) + len(v) for k, v in ev.headers)
            if not self._handshake_done:
                st.early_bytes = size
            if size > self.state.settings.max_header_bytes:
                self._quic.stop_stream(st.sid, ErrorCode.H3_REQUEST_REJECTED)
                self._answer_error(st, APIError(431, "Request header fields too large.", "invalid_request_error",
                                                None, "headers_too_large"))
            elif self._draining:
                self._refuse(st)
            elif ev.stream_ended:
                self._dispatch(st)
            elif self.state.streams_body is not None:
                self._dispatch(st, at_headers=True)
        elif isinstance(ev, DataReceived):
            st = self._streams.get(ev.stream_id)
            if st is not None and st.body_stream is not None:
                self._body_data(st, ev.data, ev.stream_ended)
                return
            if st is None or st.dispatched:
                return
            st.body += ev.data
            if not self._handshake_done:
                st.early_bytes += len(ev.data)
            if len(st.body) > self.state.settings.max_body_bytes:
                self._quic.stop_stream(st.sid, ErrorCode.H3_REQUEST_REJECTED)
                self._answer_error(st, APIError(413, "Request body too large.", "invalid_request_error",
                                                None, "request_too_large"))
            elif ev.stream_ended:
                self._dispatch(st)

    def _body_data(self, st: H3Stream, data: bytes, ended: bool) -> None:
        """DATA of a body the call reads as it arrives (dropped once that body has failed)."""
        body = st.body_stream
        if body is None or not body.open:
            return
        if not body.feed(data):
            self.state.report(413, "request body too large")  # the call answers; the rest is dropped
        elif ended:
            body.end()

    def _dispatch(self, st: H3Stream, at_headers: bool = False) -> None:
        """The request to the entrance: once its body has ended, or at its headers
        (``at_headers``) if the server state's ``streams_body`` picks it."""
        st.dispatched = True
        state = self.state
        method = path = authority = b""
        headers: Headers = []
        for k, v in st.headers:
            if k.startswith(b":"):
                if k == b":method":
                    method = v
                elif k == b":path":
                    path = v
                elif k == b":authority":
                    authority = v
            else:
                headers.append((k, v))
        target, _, query = path.partition(b"?")
        try:
            decoded = state.decode_path(target)
        except UnicodeDecodeError:
            decoded = ""
        if not method or not decoded.startswith("/"):
            if at_headers:  # answered before its body: the client should stop sending it
                self._quic.stop_stream(st.sid, ErrorCode.H3_NO_ERROR)
            self._answer_error(st, APIError(400, "Malformed request: :method and :path are required.",
                                            "invalid_request_error", None, "bad_request"))
            return
        if authority and not any(k == b"host" for k, _ in headers):
            headers.append((b"host", authority))
        early = not self._handshake_done or any(k == b"early-data" and v == b"1" for k, v in headers)
        m = method.decode("latin-1")
        req = Request(m, decoded, query.decode("latin-1"), headers, bytes(st.body), "h3", "https",
                      self._client_address(), early_data=early)
        if at_headers:
            if state.streams_body is None or not state.streams_body(req):
                st.dispatched = False  # read whole: dispatched when the body ends
                return
            req.stream = st.body_stream = BodyStream(state.settings.max_body_bytes)
        if early:
            self._early_bytes += st.early_bytes
            if not state.early_allowed(m, decoded, self._early_bytes):
                state.early_refused += 1
                if at_headers:
                    self._quic.stop_stream(st.sid, ErrorCode.H3_NO_ERROR)
                self._answer_error(st, APIError(425, "The request was sent in TLS early data (0-RTT), which "
                                                "this route does not accept; repeat it.", "invalid_request_error",
                                                None, "too_early"))
                return
            state.early_served += 1
        st.body = bytearray()
        sink = st.sink = self._sink(st, m == "HEAD")
        state.request_started()
        st.call = state.entrance(req, sink, lambda: self._done(st))

    def _answer_error(self, st: H3Stream, err: APIError) -> None:
        self.state.report(err.status, err.message)
        st.dispatched = True
        sink = self._sink(st, False)
        sink.respond(*render_http(err))
        self._streams.pop(st.sid, None)

    def _sink(self, st: H3Stream, head: bool) -> H3Sink:
        assert self._h3 is not None  # a request stream arrives only once H3 is negotiated
        return H3Sink(self, self._h3, self._quic, self.state.settings.max_stream_buffer, st, head)

    def expire_requests(self, now: float) -> None:
        """Requests whose body has not ended ``body_timeout`` after their headers: 408."""
        limit = now - self.state.settings.body_timeout
        for st in [st for st in self._streams.values() if not st.dispatched and st.opened_at <= limit]:
            self._quic.stop_stream(st.sid, ErrorCode.H3_REQUEST_REJECTED)
            self._answer_error(st, APIError(408, "The request body did not arrive in time.",
                                            "invalid_request_error", None, "request_timeout"))

    def _refuse(self, st: H3Stream) -> None:
        """A stream opened while draining: the client may retry it elsewhere (RFC 9114 4.1.1)."""
        self._streams.pop(st.sid, None)
        self._quic.reset_stream(st.sid, ErrorCode.H3_REQUEST_REJECTED)
        self._quic.stop_stream(st.sid, ErrorCode.H3_REQUEST_REJECTED)
        self.schedule_transmit()

    def _done(self, st: H3Stream) -> None:
        self._streams.pop(st.sid, None)
        if st.body_stream is not None and not st.body_stream.ended and not st.gone:
            self._quic.stop_stream(st.sid, ErrorCode.H3_NO_ERROR)  # answered: the rest is not read
        self.state.request_done()
        if self._draining:
            self._flushing.add(st.sid)
            self._close_when_flushed()

    def _client_address(self) -> tuple[str, int] | None:
        addr = self._quic.get_peer_address()
        if addr is None:
            return None
        host = str(addr[0])
        return (host[7:] if host.startswith("::ffff:") else host), int(addr[1])

    # -- the client went away ------------------------------------------------------------------
    def _client_gone(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None or st.gone:
            return
        st.gone = True
        if st.body_stream is not None:
            st.body_stream.fail(StreamGone("stream reset by the client"))
        fut = self._waiters.pop(sid, None)
        if fut is not None and not fut.done():
            fut.set_exception(StreamGone("stream reset by the client"))
        if not st.ended:
            st.ended = True
            self._quic.reset_stream(sid, ErrorCode.H3_REQUEST_CANCELLED)
            self.schedule_transmit()
        if st.call is not None:
            st.call.cancel()
        elif not st.dispatched:
            self._streams.pop(sid, None)

    def _terminated(self) -> None:
        self.state.connections.discard(self)
        for st in list(self._streams.values()):
            if not st.gone:
                st.gone = True
                st.ended = True
                if st.body_stream is not None:
                    st.body_stream.fail(StreamGone("connection closed"))
                fut = self._waiters.pop(st.sid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(StreamGone("connection closed"))
                if st.call is not None:
                    st.call.cancel()
        self._streams = {k: v for k, v in self._streams.items() if v.call is not None}

    # -- draining --------------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish the requests in flight, refuse new ones, then close."""
        self._draining = True
        self._close_when_flushed()

    def _close_when_flushed(self) -> None:
        """Close once no request is open and the peer has every byte of their responses
        (closing a QUIC connection drops what is still unacknowledged)."""
        if self._closing or self._streams:
            return
        self._flushing = {sid for sid in self._flushing if unsent(self._quic, sid)}
        if not self._flushing:
            self._closing = True
            self.close()

    def abort(self) -> None:
        self.close()
        self._terminated()

    # -- writing, for the sink -------------------------------------------------------------------
    def wait_writable(self, sid: int) -> asyncio.Future[None]:
        fut = self._waiters.get(sid)
        if fut is None:
            fut = self._waiters[sid] = self._loop.create_future()
        return fut


def protocol_factory(state: H3ServerState) -> Callable[..., H3Protocol]:
    """What aioquic's server calls per new connection."""

    def create(quic: QuicConnection, stream_handler: Any = None) -> H3Protocol:
        return H3Protocol(quic, stream_handler, state=state)

    return create
