"""HTTP/2 over the h2 library (h2c prior knowledge and ALPN ``h2``).

How it works: bytes go into ``H2Connection.receive_data``; its events drive a
small per-stream record. Headers are checked as they arrive (431, 400), the
body is collected with the same limit as HTTP/1.1 (413, checked against
content-length up front and while DATA arrives), and on END_STREAM the handler
runs as its own task. Received DATA is acknowledged at once: the limits bound
memory, and the window must not stall other streams.

Sending honours flow control: a sink writes what the smaller of the stream and
connection windows allows, then awaits a WINDOW_UPDATE (or a SETTINGS change)
for that stream. RST_STREAM or connection loss cancels the stream's handler
task. ``drain()`` sends GOAWAY (hand-built, since h2 refuses to send anything
after its own ``close_connection``), refuses new streams, and closes once the
open ones finish. Output is flushed once per loop iteration.
"""

from __future__ import annotations

import asyncio
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

from gateway.errors import APIError, render_json
from gateway.http.common import (
    ERROR_HEADERS,
    HOST_CHARS,
    ClientDisconnected,
    HttpLimits,
    ServerState,
    decode_target,
    error_body,
    http_date,
    run_request,
    spawn,
)
from gateway.http.types import Headers, Request

__all__ = ["H2Protocol"]

_HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_CONN_WINDOW = 16 << 20


class _Connection(h2.connection.H2Connection):
    """h2's connection, with a malformed request a stream error (RFC 9113 8.1.1) as it should be.

    h2 raises a connection error for a request whose header block breaks its rules (field names
    or values, connection-specific fields, pseudo-headers, content-length) or whose body does not
    match its content-length, which takes every other stream of the connection down with it.
    Here such a request is noted in ``malformed`` as (stream id, why, END_STREAM seen, DATA bytes
    left to acknowledge) for the adapter to answer with a 400; its stream is open.
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.malformed: list[tuple[int, str, bool, int]] = []

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        sid = frame.stream_id
        new = sid not in self.streams
        try:
            return super()._receive_headers_frame(frame)
        except h2.exceptions.ProtocolError as e:
            # Only a new request whose block decoded and opened its stream: h2 checks the fields
            # after that. HPACK, framing, state and subclassed errors stay connection errors.
            if not new or sid not in self.streams or type(e) is not h2.exceptions.ProtocolError:
                raise
            self.malformed.append((sid, str(e), "END_STREAM" in frame.flags, 0))
            return [], []

    def _receive_data_frame(self, frame: DataFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        try:
            return super()._receive_data_frame(frame)
        except h2.exceptions.InvalidBodyLengthError as e:  # raised before END_STREAM is taken
            self.malformed.append((frame.stream_id, str(e), False, frame.flow_controlled_length))
            return [], []


class _Stream:
    __slots__ = (
        "id",
        "method",
        "path",
        "query",
        "headers",
        "body",
        "body_len",
        "last_rx",
        "task",
        "sink",
        "waiter",
        "closed",
    )

    def __init__(self, stream_id: int, now: float) -> None:
        self.id = stream_id
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: Headers = []
        self.body: list[bytes] = []
        self.body_len = 0
        self.last_rx = now
        self.task: asyncio.Task[None] | None = None
        self.sink: _H2Sink | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False  # reset, or answered by the adapter itself


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection, server side."""

    def __init__(self, state: ServerState, *, tls: bool = False) -> None:
        self._srv = state
        self._limits = limits = state.limits
        self._scheme = "https" if tls else "http"
        self._loop = asyncio.get_running_loop()
        # Our own response headers are lower-case and well formed: skip h2's
        # per-header outbound checks (a measurable share of h2's CPU per request).
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self._h2 = _Connection(config)
        self._h2.local_settings = _local_settings(limits, limits.h2_max_concurrent_streams)
        # A header block past the limit gets a 431 on its stream; only one far past
        # it (memory guard) is a connection error inside hpack.
        self._h2.decoder.max_header_list_size = max(4 * limits.max_header_bytes, 65536)
        self._transport: asyncio.Transport | None = None
        self._client: tuple[str, int] | None = None
        self._streams: dict[int, _Stream] = {}
        self._flush_scheduled = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._goaway_sent = False
        self._peer_gone = False
        self._last_activity = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._tick = min(1.0, limits.body_timeout / 4, limits.keepalive_timeout / 4)

    # ---- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
        self._srv.connections.add(self)
        self._h2.initiate_connection()
        # h2 treats a stream past the advertised MAX_CONCURRENT_STREAMS as a connection error,
        # losing every stream of that read (a client may open more before it reads our SETTINGS);
        # RFC 9113 5.1.2 makes it a stream error. So h2 keeps no limit of its own once the
        # SETTINGS are framed, and _on_request refuses the extra streams.
        self._h2.local_settings = _local_settings(self._limits, 2**31 - 1)
        self._h2.increment_flow_control_window(_CONN_WINDOW - 65535)
        self._last_activity = self._loop.time()
        self._timer = self._loop.call_later(self._tick, self._on_tick)
        self._flush()
        if self._srv.draining:
            self.drain()

    def data_received(self, data: bytes) -> None:
        self._last_activity = now = self._loop.time()
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._flush()
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
                self._wake(ev.stream_id)
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                self._wake(0)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self._peer_gone = True
                self._goaway_sent = True  # no new streams either way
                if not self._streams:
                    self._close()
        if self._h2.malformed:
            self._answer_malformed(now)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._srv.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for st in self._streams.values():
            st.closed = True
            if st.task is not None:
                st.task.cancel()
            if st.waiter is not None and not st.waiter.done():
                st.waiter.cancel()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

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

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ---- events -----------------------------------------------------------
    def _on_request(self, ev: h2.events.RequestReceived, now: float) -> None:
        sid = ev.stream_id
        if self._goaway_sent or self._at_stream_limit():
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)  # never started: the client may retry it
            return
        st = _Stream(sid, now)
        self._streams[sid] = st
        done = ev.stream_ended is not None  # its StreamEnded event follows and dispatches
        limits = self._limits
        size = 0
        authority = b""
        raw_path = b""
        headers: Headers = []
        for name, value in ev.headers or ():
            k, v = bytes(name), bytes(value)
            size += len(k) + len(v) + 32
            if k[:1] == b":":
                if k == b":method":
                    st.method = v.decode("ascii", "replace")
                elif k == b":path":
                    raw_path = v
                elif k == b":authority":
                    authority = v
                continue
            if not v.isascii():
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError:
                    self._reject(st, 400, "invalid UTF-8 in request header", done)
                    return
            if k == b"content-length" and v.isdigit() and int(v) > limits.max_body_bytes:
                self._reject(st, 413, f"request body exceeds {limits.max_body_bytes} bytes", done)
                return
            headers.append((k, v))
        if size > limits.max_header_bytes:
            self._reject(st, 431, "request headers too large", done)
            return
        # h2 has checked there is one Host or :authority and that they agree (RFC 9113 8.3.1)
        if authority:
            if not any(k == b"host" for k, _ in headers):
                headers.append((b"host", authority))
        else:
            authority = next((v for k, v in headers if k == b"host"), b"")
        if authority.translate(None, HOST_CHARS):
            self._reject(st, 400, "malformed request: invalid :authority or Host", done)
            return
        path, _, query = raw_path.partition(b"?")
        try:
            st.path = decode_target(path)
            st.query = query.decode("utf-8")
        except UnicodeDecodeError:
            self._reject(st, 400, "invalid UTF-8 in request target", done)
            return
        st.headers = headers

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
                st = self._streams[sid] = _Stream(sid, now)
            elif st.closed or st.task is not None:
                continue
            self._reject(st, 400, f"malformed request: {why}", client_done)
        self._h2.malformed.clear()

    def _at_stream_limit(self) -> bool:
        limit = self._limits.h2_max_concurrent_streams
        if len(self._streams) < limit:
            return False
        # a stream the client reset is closed to it even while its handler is still unwinding
        return sum(not st.closed for st in self._streams.values()) >= limit

    def _on_data(self, ev: h2.events.DataReceived, now: float) -> None:
        sid = ev.stream_id
        self._h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        st = self._streams.get(sid)
        if st is None or st.closed or st.task is not None:
            return
        data = ev.data or b""
        st.body_len += len(data)
        if st.body_len > self._limits.max_body_bytes:
            self._reject(st, 413, f"request body exceeds {self._limits.max_body_bytes} bytes", False)
            return
        st.body.append(data)
        st.last_rx = now

    def _on_end(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            return
        if st.closed:
            self._forget(st)
        elif st.task is None:
            self._dispatch(st)

    def _on_reset(self, sid: int) -> None:
        st = self._streams.get(sid)
        if st is None:
            return
        st.closed = True
        if st.waiter is not None and not st.waiter.done():
            st.waiter.cancel()
        if st.task is not None:
            st.task.cancel()  # _task_done forgets the stream
        else:
            self._forget(st)

    def _wake(self, sid: int) -> None:
        streams = self._streams.values() if sid == 0 else [s for s in (self._streams.get(sid),) if s]
        for st in streams:
            w, st.waiter = st.waiter, None
            if w is not None and not w.done():
                w.set_result(None)

    # ---- requests ---------------------------------------------------------
    def _dispatch(self, st: _Stream) -> None:
        parts = st.body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        st.body = []
        request = Request(st.method, st.path, st.query, st.headers, body, "h2", self._scheme, self._client)
        sink = _H2Sink(self, st, st.method == "HEAD")
        st.sink = sink
        self._srv.request_started()
        st.task = task = spawn(self._loop, run_request(self._srv.handler, request, sink))
        task.add_done_callback(sink._task_done)

    def _reject(self, st: _Stream, status: int, message: str, client_done: bool) -> None:
        """Answer a request ourselves (it never reaches the handler)."""
        self._srv.report(status, "h2", message)
        body = error_body(status, message)
        sid = st.id
        hdrs = _response_headers(status, ERROR_HEADERS)
        hdrs.append((b"content-length", b"%d" % len(body)))
        try:
            fits = self._h2.local_flow_control_window(sid) >= len(body)
            self._h2.send_headers(sid, hdrs)
            if not fits:  # the body waits for the client's window, as a handler's would
                st.task = spawn(self._loop, self._finish_reject(st, body, client_done))
                return
            self._h2.send_data(sid, body, end_stream=True)
        except h2.exceptions.StreamClosedError:
            client_done = True
        st.closed = True
        if not client_done:  # RFC 9113 8.1: stop the upload without an error
            self._reset(sid, ErrorCodes.NO_ERROR)
        self._forget(st)

    async def _finish_reject(self, st: _Stream, body: bytes, client_done: bool) -> None:
        try:
            await self._send(st, body, True)
            if not client_done:
                self._reset(st.id, ErrorCodes.NO_ERROR)
        except ClientDisconnected:
            pass
        finally:
            st.closed = True
            self._forget(st)
            self._schedule_flush()

    def _forget(self, st: _Stream) -> None:
        self._streams.pop(st.id, None)
        if self._goaway_sent and not self._streams:
            self._close()

    def _stream_done(self, st: _Stream) -> None:
        self._srv.request_done()
        if self._transport is not None and not st.closed:
            sink = st.sink
            if sink is None or not sink.ended:  # cut mid-stream: the client must see it broke
                self._reset(st.id, ErrorCodes.INTERNAL_ERROR)
        st.closed = True
        self._forget(st)
        self._schedule_flush()

    def _reset(self, sid: int, code: ErrorCodes) -> None:
        try:
            self._h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            pass

    # ---- timer ------------------------------------------------------------
    def _on_tick(self) -> None:
        self._timer = None
        if self._transport is None:
            return
        now = self._loop.time()
        limit = self._limits.body_timeout
        for st in [s for s in self._streams.values() if s.task is None and not s.closed]:
            if now - st.last_rx > limit:
                self._reject(st, 408, "timed out waiting for request body", False)
        if not self._streams and now - self._last_activity > self._limits.keepalive_timeout:
            self.drain()
        self._flush()
        if self._transport is not None:
            self._timer = self._loop.call_later(self._tick, self._on_tick)

    # ---- output -----------------------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is None:
            return
        data = self._h2.data_to_send()
        if data:
            self._transport.write(data)

    def _close(self) -> None:
        self._flush()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()

    async def _send(self, st: _Stream, data: bytes, end: bool) -> None:
        """DATA frames within the peer's windows; waits for WINDOW_UPDATE."""
        h2c = self._h2
        view = memoryview(data)
        pos, total = 0, len(data)
        while True:
            if st.closed or self._transport is None:
                raise ClientDisconnected("stream closed by client")
            n = min(h2c.local_flow_control_window(st.id), h2c.max_outbound_frame_size, total - pos)
            if n <= 0 and pos < total:
                self._schedule_flush()  # what is already framed goes out while we wait
                st.waiter = self._loop.create_future()
                await st.waiter
                continue
            last = pos + n >= total
            h2c.send_data(
                st.id, view[pos : pos + n].tobytes() if n != total else data, end_stream=end and last
            )
            pos += n
            if last:
                break
        self._schedule_flush()
        if self._write_paused:
            if self._drain_waiter is None:
                self._drain_waiter = self._loop.create_future()
            await self._drain_waiter


def _local_settings(limits: HttpLimits, max_streams: int) -> h2.settings.Settings:
    return h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.h2_initial_window_size,
        },
    )


def _response_headers(status: int, headers: Headers) -> Headers:
    out: Headers = [(b":status", b"%d" % status), (b"date", http_date())]
    for k, v in headers:
        if k not in _HOP_BY_HOP:
            out.append((k, v))
    return out


class _H2Sink:
    """:class:`ResponseSink` for one HTTP/2 stream."""

    __slots__ = ("_conn", "_st", "_head", "started", "ended")

    def __init__(self, conn: H2Protocol, st: _Stream, head: bool) -> None:
        self._conn = conn
        self._st = st
        self._head = head
        self.started = False
        self.ended = False

    def _headers(self, status: int, headers: Headers, end: bool) -> None:
        if self.started:
            raise RuntimeError("response already started")
        if self._st.closed or self._conn._transport is None:
            raise ClientDisconnected("stream closed by client")
        self.started = True
        self._conn._h2.send_headers(self._st.id, headers, end_stream=end)
        self._conn._schedule_flush()

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        hdrs = _response_headers(status, headers)
        hdrs.append((b"content-length", b"%d" % len(body)))
        empty = not body or self._head
        self._headers(status, hdrs, empty)
        if empty:
            self.ended = True
            return
        await self._conn._send(self._st, body, True)
        self.ended = True

    async def start(self, status: int, headers: Headers) -> None:
        self._headers(status, _response_headers(status, headers), False)

    async def send(self, data: bytes) -> None:
        if not self.started or self.ended:
            raise RuntimeError("send() outside start()..end()")
        if data and not self._head:
            await self._conn._send(self._st, data, False)

    def send_nowait(self, data: bytes) -> bool:
        """Optional fast path of :meth:`send` for push-style producers (see the h1 sink): frame
        ``data`` now and return True when it fits the peer's flow-control windows and one frame;
        return False, framing nothing, when it does not, while the transport is paused, or when
        the stream is gone -- the caller then awaits :meth:`send` with the same data, which
        waits for windows (or raises :class:`ClientDisconnected`)."""
        if not self.started or self.ended:
            raise RuntimeError("send_nowait() outside start()..end()")
        conn, st = self._conn, self._st
        if st.closed or conn._transport is None or conn._write_paused:
            return False
        if not data or self._head:
            return True
        h2c = conn._h2
        if len(data) > min(h2c.local_flow_control_window(st.id), h2c.max_outbound_frame_size):
            return False
        h2c.send_data(st.id, data, end_stream=False)
        conn._schedule_flush()
        return True

    async def end(self) -> None:
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.ended:
            return
        self.ended = True
        if not self._st.closed and self._conn._transport is not None:
            self._conn._h2.end_stream(self._st.id)
            self._conn._schedule_flush()

    def fail(self, err: APIError) -> None:
        if self._st.closed or self._conn._transport is None:
            return
        if not self.started:
            body = render_json(err)
            hdrs = _response_headers(err.status, ERROR_HEADERS)
            if err.retry_after is not None:
                hdrs.append((b"retry-after", b"%d" % max(0, round(err.retry_after))))
            hdrs.append((b"content-length", b"%d" % len(body)))
            conn = self._conn
            sid = self._st.id
            fits = not self._head and conn._h2.local_flow_control_window(sid) >= len(body)
            self._headers(err.status, hdrs, not fits)
            if fits:
                conn._h2.send_data(sid, body, end_stream=True)
            self.ended = True
        # else: _stream_done resets the stream, so the client sees it broke

    def finish(self) -> None:
        if not self.started:
            self.fail(APIError(500, "handler returned without a response", "server_error"))
        elif not self.ended and not self._st.closed and self._conn._transport is not None:
            self.ended = True
            self._conn._h2.end_stream(self._st.id)
            self._conn._schedule_flush()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._conn._stream_done(self._st)
