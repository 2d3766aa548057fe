"""HTTP/2 adapter over the h2 library (h2c prior knowledge and ALPN ``h2``).

How it works: bytes go into ``H2ServerConnection.receive_data``; its events drive a small
per-stream record (:mod:`gateway.http.h2_stream`). Headers are checked as they arrive
(431, 400), the body is collected with the same limit as HTTP/1.1 (413, checked against
content-length up front and while DATA arrives), and on END_STREAM the request goes to the
one entrance. Received DATA is acknowledged at once: the limits bound memory, and the window
must not stall other streams. A request the server state's ``streams_body`` predicate picks
(gRPC-Web, native gRPC) goes to the entrance at HEADERS instead, its body an
:class:`~gateway.http.body_stream.H2BodyStream` acknowledged only as the call reads it. Errors
we answer ourselves go out like any response, through :meth:`H2Protocol._answer`, so a body
larger than the peer's window waits for it.

RST_STREAM or connection loss cancels the stream's call. ``drain()`` sends GOAWAY
(hand-built, since h2 refuses to send anything after its own ``close_connection``), refuses
new streams, and closes once the open ones finish. One lazy timer covers body stalls (408)
and the idle connection; output is flushed once per loop iteration.
"""

from __future__ import annotations

import asyncio
import logging
from math import inf

import h2.config
import h2.events
import h2.exceptions
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from gateway.errors import error_headers, render_json
from gateway.http.adapter import StreamAdapter
from gateway.http.body_stream import H2BodyStream
from gateway.http.common import ClientDisconnected, ServerState, protocol_error
from gateway.http.h2_guard import GuardLimits, H2FrameGuard, Violation
from gateway.http.h2_stream import (
    FINISHED,
    RECEIVING,
    RUNNING,
    H2ServerConnection,
    H2Sink,
    H2Stream,
    local_settings,
    read_head,
    response_headers,
)
from gateway.http.types import Headers, Request

log = logging.getLogger("gateway.http")
__all__ = ["H2Protocol"]

_CONN_WINDOW = 16 << 20


class H2Protocol(StreamAdapter):
    """One HTTP/2 connection, server side."""

    def __init__(self, state: ServerState, *, tls: bool = False) -> None:
        super().__init__(state, tls=tls)
        limits = self._limits
        # Our own response headers are lower-case and well formed: skip h2's
        # per-header outbound checks (a measurable share of h2's CPU per request).
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self._h2 = H2ServerConnection(config)
        self._h2.local_settings = local_settings(limits, limits.h2_max_concurrent_streams)
        # A header block past the limit gets a 431 on its stream; only one far past
        # it (memory guard) is a connection error inside hpack.
        self._h2.decoder.max_header_list_size = max(4 * limits.max_header_bytes, 65536)
        self._streams: dict[int, H2Stream] = {}
        self._goaway_sent = False
        self._last_activity = 0.0
        self._guard = H2FrameGuard(GuardLimits.for_header_limit(limits.max_header_bytes), self._loop.time())

    # ---- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._attach(transport)
        self._h2.initiate_connection()
        # h2 treats a stream past the advertised MAX_CONCURRENT_STREAMS as a connection error,
        # losing every stream of that read (a client may open more before it reads our SETTINGS);
        # RFC 9113 5.1.2 makes it a stream error. So h2 keeps no limit of its own once the
        # SETTINGS are framed, and _on_request refuses the extra streams.
        self._h2.local_settings = local_settings(self._limits, 2**31 - 1)
        self._h2.increment_flow_control_window(_CONN_WINDOW - 65535)
        self._last_activity = now = self._loop.time()
        self._set_deadline(now + self._limits.keepalive_timeout)
        self._flush()
        if self._srv.draining:
            self.drain()

    def data_received(self, data: bytes) -> None:
        self._last_activity = now = self._loop.time()
        violation = self._guard.feed(data, now)
        if violation is not None:
            self._calm_down(violation)
            return
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._close()
            return
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self._on_data(ev, now)
            elif isinstance(ev, h2.events.RequestReceived):
                self._on_request(ev, now)
            elif isinstance(ev, h2.events.StreamEnded):
                self._on_end(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                self._on_reset(ev.stream_id)
            elif isinstance(ev, h2.events.WindowUpdated):
                self._window_opened(ev.stream_id)
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                self._window_opened(0)
            elif isinstance(ev, h2.events.ConnectionTerminated):  # the client's GOAWAY (H2ServerConnection)
                self._goaway_sent = True  # no new streams either way
                if not self._streams or ev.error_code:  # an error: it gives up on its calls too
                    self._close()
        if self._h2.malformed:
            self._answer_malformed(now)
        self._flush()

    def _lost(self) -> None:
        for st in list(self._streams.values()):
            st.drop_body(ClientDisconnected("connection lost"))
            st.reset = True
            st.out.clear()
            st.wake()
            if st.call is not None:
                st.call.cancel()

    # ---- server control ---------------------------------------------------
    def drain(self) -> None:
        """GOAWAY: refuse new streams, finish open ones, then close."""
        if self._goaway_sent or self._transport is None:
            return
        self._goaway_sent = True
        self._flush()
        frame = GoAwayFrame(0, last_stream_id=self._h2.highest_inbound_stream_id, error_code=0)
        self._transport.write(frame.serialize())
        if not self._streams:
            self._close()

    # ---- events -----------------------------------------------------------
    def _on_request(self, ev: h2.events.RequestReceived, now: float) -> None:
        sid = ev.stream_id
        if self._goaway_sent or self._at_stream_limit():
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)  # never started: the client may retry it
            return
        st = self._streams[sid] = H2Stream(sid, now)
        st.client_done = ev.stream_ended is not None  # its StreamEnded event follows and dispatches
        if not st.client_done and now + self._limits.body_timeout < self._deadline:
            self._set_deadline(now + self._limits.body_timeout)
        rejected = read_head(st, ev.headers or (), self._limits)
        if rejected is not None:
            return self._reject(st, *rejected)
        wants_stream = self._srv.streams_body
        if wants_stream is not None and not st.client_done:
            request = self._request(st, b"")
            if wants_stream(request):  # the call reads the body as it comes (full duplex)
                st.body_stream = H2BodyStream(self._h2, st.id, self._schedule_flush, self._limits.streamed_body_limit)
                request.stream = st.body_stream
                self._start(st, request)

    def _answer_malformed(self, now: float) -> None:
        answered: set[int] = set()  # one stream may be noted again by its following DATA frames
        for sid, why, client_done, unacked in self._h2.malformed:
            if unacked:
                self._h2.acknowledge_received_data(unacked, sid)
            if sid in answered:
                continue
            answered.add(sid)
            st = self._streams.get(sid)
            if st is None:
                st = self._streams[sid] = H2Stream(sid, now)
            elif st.reset or st.phase != RECEIVING:
                st.drop_body(protocol_error(400, f"malformed request: {why}"))
                continue
            st.client_done = st.client_done or client_done
            self._reject(st, 400, f"malformed request: {why}")
        self._h2.malformed.clear()

    def _at_stream_limit(self) -> bool:
        limit = self._limits.h2_max_concurrent_streams
        if len(self._streams) < limit:
            return False
        # a stream the client reset is closed to it even while its call is still unwinding
        return sum(not st.reset for st in self._streams.values()) >= limit

    def _on_data(self, ev: h2.events.DataReceived, now: float) -> None:
        sid = ev.stream_id
        st = self._streams.get(sid)
        if st is not None and st.body_stream is not None and st.body_stream.open:  # acknowledged as read
            if not st.body_stream.feed(ev.data or b"", ev.flow_controlled_length):
                self._srv.report(413, "h2", "request body too large")
                st.rst_after = True  # the call answers (its error); then the upload is stopped
            return
        self._h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        if st is None or st.reset or st.phase != RECEIVING:
            return
        data = ev.data or b""
        st.body_len += len(data)
        if st.body_len > self._limits.max_body_bytes:
            return self._reject(st, 413, f"request body exceeds {self._limits.max_body_bytes} bytes")
        st.add_body(data)
        st.last_rx = now

    def _on_end(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            return
        st.client_done = True
        if st.body_stream is not None:
            st.body_stream.end()
        if st.phase == RECEIVING and not st.reset:
            self._dispatch(st)
        else:
            self._settle(st)

    def _on_reset(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            return
        st.drop_body(ClientDisconnected("stream reset by client"))
        st.reset = True
        st.out.clear()
        st.wake()
        if st.call is not None:
            st.call.cancel()  # _done forgets the stream
        else:
            self._settle(st)

    # ---- requests ---------------------------------------------------------
    def _dispatch(self, st: H2Stream) -> None:
        self._start(st, self._request(st, st.take_body()))

    def _request(self, st: H2Stream, body: bytes) -> Request:
        return Request(st.method, st.path, st.query, st.headers, body, "h2", self._scheme, self._client)

    def _start(self, st: H2Stream, request: Request) -> None:
        st.phase = RUNNING
        st.sink = sink = H2Sink(self, st, st.method == "HEAD")
        self._srv.request_started()
        st.call = self._srv.entrance(request, sink, lambda: self._done(st))

    def _calm_down(self, v: Violation) -> None:
        """GOAWAY and close: the client abuses cheap frames or header blocks (gateway.http.h2_guard)."""
        log.warning("h2 connection from %s closed: %s", self._client, v.reason)
        code = ErrorCodes.COMPRESSION_ERROR if v.header_flood else ErrorCodes.ENHANCE_YOUR_CALM
        if self._transport is not None:
            self._flush()
            last = self._h2.highest_inbound_stream_id
            self._transport.write(GoAwayFrame(0, last_stream_id=last, error_code=code).serialize())
            self._goaway_sent = True
            self._transport.close()

    def _done(self, st: H2Stream) -> None:
        if not st.reset:  # answered, not reset by the client: what resets are measured against
            self._guard.stream_completed()
        self._srv.request_done()
        st.call = None
        st.phase = FINISHED
        if st.body_stream is not None:  # the call is over: the rest of an upload is not read
            st.rst_after = st.rst_after or not st.client_done
            st.drop_body(ClientDisconnected("the call has ended"))
        if not st.reset and (st.sink is None or not st.sink.ended):  # the client must see it broke
            self._reset(st, ErrorCodes.INTERNAL_ERROR)
        self._settle(st)
        self._schedule_flush()

    def _reject(self, st: H2Stream, status: int, message: str) -> None:
        """Answer a request ourselves (it never reaches the entrance)."""
        self._srv.report(status, "h2", message)
        err = protocol_error(status, message)
        body = render_json(err)
        st.phase = FINISHED
        st.rst_after = True  # RFC 9113 8.1: once answered, stop the upload without an error
        self._answer(st, response_headers(status, error_headers(err), len(body)), body)

    def _answer(self, st: H2Stream, headers: Headers, body: bytes) -> None:
        """A whole response: headers, then the body as the windows allow."""
        if self._send_headers(st, headers, not body):
            if body:
                st.out.append(body)
            st.out_end = True
            self._pump(st)
        self._settle(st)

    def _send_headers(self, st: H2Stream, headers: Headers, end: bool) -> bool:
        try:
            self._h2.send_headers(st.id, headers, end_stream=end)
        except h2.exceptions.ProtocolError:  # closed to us meanwhile (its RST is in this read)
            st.reset = True
            return False
        self._schedule_flush()
        return True

    def _end_stream(self, st: H2Stream) -> None:
        """END_STREAM, on the trailers if the response has any."""
        trailers, st.trailers = st.trailers, None
        try:
            if trailers:
                self._h2.send_headers(st.id, trailers, end_stream=True)
            else:
                self._h2.end_stream(st.id)
        except h2.exceptions.ProtocolError:
            st.reset = True
        self._schedule_flush()

    def _settle(self, st: H2Stream) -> None:
        """Forget a stream once its call is done and its response has left (or it was reset)."""
        if st.phase == RUNNING:
            return
        if not st.reset and (st.out or not st.out_end):
            return
        if st.out_end and st.rst_after and not st.client_done and not st.reset:
            self._reset(st, ErrorCodes.NO_ERROR)
        self._streams.pop(st.id, None)
        if self._goaway_sent and not self._streams:
            self._close()
        elif not self._streams and self._transport is not None:  # idle from now: the keep-alive clock
            self._set_deadline(min(self._deadline, self._last_activity + self._limits.keepalive_timeout))

    def _reset(self, st: H2Stream, code: ErrorCodes) -> None:
        st.reset = True
        st.out.clear()
        st.wake()
        try:
            self._h2.reset_stream(st.id, code)
        except h2.exceptions.ProtocolError:
            pass
        self._schedule_flush()

    # ---- output -----------------------------------------------------------
    def _pump(self, st: H2Stream) -> None:
        """Frame what the windows allow of a stream's held-back DATA (END_STREAM with the last)."""
        h2c = self._h2
        out = st.out
        while out:
            data = out[0]
            off = st.out_off
            n = min(h2c.local_flow_control_window(st.id), h2c.max_outbound_frame_size, len(data) - off)
            if n <= 0:
                return
            whole = off + n == len(data)
            last = st.out_end and whole and len(out) == 1
            h2c.send_data(st.id, data if off == 0 and whole else data[off : off + n],
                          end_stream=last and st.trailers is None)
            if whole:
                out.pop(0)
                st.out_off = 0
            else:
                st.out_off = off + n
            if last and st.trailers is not None:
                self._end_stream(st)
        st.wake()

    def _window_opened(self, sid: int) -> None:
        streams = list(self._streams.values()) if sid == 0 else [s for s in (self._streams.get(sid),) if s]
        for st in streams:
            if st.out and not st.reset:
                self._pump(st)
                if not st.out:
                    self._settle(st)

    def _take_output(self) -> bytes:
        return self._h2.data_to_send()

    # ---- timer ------------------------------------------------------------
    def _deadline_passed(self) -> None:
        now = self._loop.time()
        limit = self._limits.body_timeout
        nxt = inf
        for st in [s for s in self._streams.values() if s.phase == RECEIVING and not s.reset]:
            if now - st.last_rx > limit:
                self._reject(st, 408, "timed out waiting for request body")
            else:
                nxt = min(nxt, st.last_rx + limit)
        if not self._streams:
            idle_at = self._last_activity + self._limits.keepalive_timeout
            if now >= idle_at:
                self.drain()
            else:
                nxt = min(nxt, idle_at)
        self._flush()
        self._deadline = inf
        if nxt < inf and self._transport is not None:
            self._set_deadline(nxt)
