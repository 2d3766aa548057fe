"""HTTP/2 pieces below the protocol class: h2's connection (with malformed requests made
stream errors), one stream's record with its held-back output, and its response sink.

How output works: a stream frames what the smaller of its and the connection's windows
allows; the rest waits in :attr:`H2Stream.out` (with END_STREAM, and maybe a RST_STREAM, to
follow it) and the connection's ``_pump`` sends more as WINDOW_UPDATEs arrive. Only ``send``
waits: until its data has left the queue, and while the transport is paused.

The sink reaches its connection through :class:`H2Output`, the members of
:class:`~gateway.http.h2.H2Protocol` it calls: that module imports this one, so this one does
not import it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame

from gateway.http.adapter import SinkState
from gateway.http.body_stream import PIECE, H2BodyStream
from gateway.http.common import (
    HOST_CHARS,
    ClientDisconnected,
    HttpLimits,
    ServerState,
    decode_target,
    http_date,
)
from gateway.http.types import Call, Headers

# hpack logs every header it decodes at DEBUG, Authorization values included: API keys must never
# reach a log, whatever the gateway's level.
logging.getLogger("hpack").setLevel(logging.INFO)

__all__ = [
    "H2ServerConnection",
    "H2Stream",
    "H2Sink",
    "H2Output",
    "local_settings",
    "response_headers",
    "read_head",
    "RECEIVING",
    "RUNNING",
    "FINISHED",
]

_HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
RECEIVING, RUNNING, FINISHED = 0, 1, 2  # H2Stream.phase: request arriving, call running, call done


class H2ServerConnection(h2.connection.H2Connection):
    """h2's connection, with a malformed request a stream error (RFC 9113 8.1.1) as it should be.

    h2 raises a connection error for a request whose header block breaks its rules (field names
    or values, connection-specific fields, pseudo-headers, content-length) or whose body does not
    match its content-length, which takes every other stream of the connection down with it.
    Here such a request is noted in ``malformed`` as (stream id, why, END_STREAM seen, DATA bytes
    left to acknowledge) for the adapter to answer with a 400; its stream is open.

    Why this overrides two private methods: h2's public API has no way to make these stream
    errors. ``H2Configuration(validate_inbound_headers=False)`` would skip the field checks (we
    would then re-implement h2's validation per stream), but the content-length checks are not
    governed by any option: ``H2Stream._initialize_content_length`` (bad or conflicting
    content-length on HEADERS) and ``_track_content_length`` (a body longer or shorter than
    declared, on DATA) always raise out of ``receive_data``, after h2 has moved its state past
    the frame and with the rest of the read unprocessed. Only here, per frame, can the error be
    caught with the stream's state intact. Pinned by tests/integration/test_adversarial.py
    (``test_h2_malformed_request_is_a_400_on_its_stream_not_the_connection``).
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

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        """The client's GOAWAY, reported (ConnectionTerminated) and nothing more.

        h2 closes its whole connection on it, both ways, and drops the output it has queued: the
        calls the client still waits for could send nothing more and their DATA would be a
        connection error. But a GOAWAY only says its sender opens no more streams (RFC 9113
        6.8): the adapter refuses new ones and finishes the open ones (or, for a GOAWAY that
        carries an error, closes the connection and cancels them)."""
        ev = h2.events.ConnectionTerminated()
        try:
            ev.error_code = ErrorCodes(frame.error_code)
        except ValueError:
            ev.error_code = frame.error_code
        ev.last_stream_id = frame.last_stream_id
        ev.additional_data = frame.additional_data or None
        return [], [ev]

    def _receive_data_frame(self, frame: DataFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        try:
            return super()._receive_data_frame(frame)
        except h2.exceptions.InvalidBodyLengthError as e:  # raised before END_STREAM is taken
            self.malformed.append((frame.stream_id, str(e), False, frame.flow_controlled_length))
            return [], []


def local_settings(limits: HttpLimits, max_streams: int) -> h2.settings.Settings:
    return h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.h2_initial_window_size,
        },
    )


def response_headers(status: int, headers: Headers, length: int | None) -> Headers:
    out: Headers = [(b":status", b"%d" % status), (b"date", http_date())]
    for k, v in headers:
        if k not in _HOP_BY_HOP:
            out.append((k, v))
    if length is not None:
        out.append((b"content-length", b"%d" % length))
    return out


class H2Stream:
    __slots__ = (
        "id", "method", "path", "query", "headers", "body", "body_len", "last_rx", "phase",
        "client_done", "reset", "call", "sink", "out", "out_off", "out_end", "rst_after", "waiter",
        "trailers", "body_stream",
    )  # fmt: skip

    def __init__(self, stream_id: int, now: float) -> None:
        self.id = stream_id
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: Headers = []
        self.body: list[bytes | bytearray] = []  # a body read whole, as it arrives (add_body)
        self.body_len = 0
        self.last_rx = now
        self.phase = RECEIVING
        self.client_done = False  # the client ended its side
        self.reset = False  # closed for output: reset by either side, or the connection is gone
        self.call: Call | None = None
        self.sink: H2Sink | None = None
        self.out: list[bytes] = []  # DATA held back by flow control
        self.out_off = 0  # how much of out[0] is sent
        self.out_end = False  # END_STREAM after out (set once the response has ended)
        self.rst_after = False  # then RST_STREAM(NO_ERROR): stop an upload we answered early
        self.waiter: asyncio.Future[None] | None = None  # a send() waiting for out to empty
        self.trailers: Headers | None = None  # a trailing HEADERS frame ends the stream, after out
        self.body_stream: H2BodyStream | None = None  # the request body, when the call reads it as it comes

    def add_body(self, data: bytes) -> None:
        """Body bytes of a request read whole. Small DATA frames are joined up to ``PIECE`` bytes,
        as a streamed body's are: a client sending its body a byte a frame must not make each
        byte cost an object (40 bytes of memory per byte under the body limit)."""
        body = self.body
        if body and len(body[-1]) + len(data) <= PIECE:
            last = body[-1]
            if type(last) is not bytearray:
                body[-1] = last = bytearray(last)
            last += data
        else:
            body.append(data)

    def take_body(self) -> bytes:
        parts, self.body = self.body, []
        if len(parts) == 1 and type(parts[0]) is bytes:
            return parts[0]
        return b"".join(parts)

    def drop_body(self, error: BaseException) -> None:
        """A streamed body nobody will read: fail it (what it held goes back to the windows)."""
        if self.body_stream is not None:
            self.body_stream.fail(error)

    def wake(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)


def read_head(st: H2Stream, fields: Iterable[tuple[bytes, bytes]], limits: HttpLimits) -> tuple[int, str] | None:
    """Fill ``st``'s method, path, query and headers from a request's header block; or the
    (status, message) to refuse it with (400, 413 by content-length, 431)."""
    size = 0
    authority = b""
    raw_path = b""
    headers: Headers = []
    for name, value in fields:
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
                return 400, "invalid UTF-8 in request header"
        if k == b"content-length" and v.isdigit() and int(v) > limits.max_body_bytes:
            return 413, f"request body exceeds {limits.max_body_bytes} bytes"
        headers.append((k, v))
    if size > limits.max_header_bytes:
        return 431, "request headers too large"
    # h2 has checked there is one Host or :authority and that they agree (RFC 9113 8.3.1)
    if authority:
        if not any(k == b"host" for k, _ in headers):
            headers.append((b"host", authority))
    else:
        authority = next((v for k, v in headers if k == b"host"), b"")
    if authority.translate(None, HOST_CHARS):
        return 400, "malformed request: invalid :authority or Host"
    path, _, query = raw_path.partition(b"?")
    try:
        st.path = decode_target(path)
        st.query = query.decode("utf-8")
    except UnicodeDecodeError:
        return 400, "invalid UTF-8 in request target"
    st.headers = headers
    return None


class H2Output(Protocol):
    """What an :class:`H2Sink` calls on its connection, :class:`~gateway.http.h2.H2Protocol`.

    The sink is the connection's per-stream face, kept in this module for size, so these are the
    connection's own members (its :class:`~gateway.http.adapter.StreamAdapter` base's among them)."""

    @property
    def _srv(self) -> ServerState: ...
    @property
    def _loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def _transport(self) -> asyncio.Transport | None: ...
    @property
    def _write_paused(self) -> bool: ...
    @property
    def _h2(self) -> H2ServerConnection: ...

    def _schedule_flush(self) -> None: ...
    async def _drain(self) -> None: ...
    def _answer(self, st: H2Stream, headers: Headers, body: bytes) -> None: ...
    def _send_headers(self, st: H2Stream, headers: Headers, end: bool) -> bool: ...
    def _pump(self, st: H2Stream) -> None: ...
    def _end_stream(self, st: H2Stream) -> None: ...
    def _reset(self, st: H2Stream, code: ErrorCodes) -> None: ...


class H2Sink(SinkState):
    """:class:`~gateway.http.types.ResponseSink` for one HTTP/2 stream."""

    __slots__ = ("_conn", "_st")

    def __init__(self, conn: H2Output, st: H2Stream, head: bool) -> None:
        super().__init__(head)
        self._conn = conn
        self._st = st

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._begin()
        self.ended = True
        extra = self._conn._srv.extra_headers
        if extra:
            headers = [*headers, *extra]
        if not self._st.reset:
            self._conn._answer(
                self._st, response_headers(status, headers, len(body)), b"" if self._head else body
            )

    def start(self, status: int, headers: Headers) -> None:
        self._begin()
        extra = self._conn._srv.extra_headers
        if extra:
            headers = [*headers, *extra]
        if not self._st.reset:
            self._conn._send_headers(self._st, response_headers(status, headers, None), False)

    async def send(self, data: bytes) -> None:
        self._in_body("send")
        conn, st = self._conn, self._st
        if st.reset:
            raise ClientDisconnected("stream closed by client")
        if data and not self._head:
            st.out.append(data)
            conn._pump(st)
            conn._schedule_flush()
            while st.out:  # what the windows hold back goes as WINDOW_UPDATEs come
                if st.reset:
                    raise ClientDisconnected("stream closed by client")
                st.waiter = conn._loop.create_future()
                await st.waiter
            if st.reset:  # woken because the stream was reset, its queue dropped
                raise ClientDisconnected("stream closed by client")
        if conn._write_paused or conn._transport is None:
            await conn._drain()

    def send_nowait(self, data: bytes) -> bool:
        self._in_body("send_nowait")
        conn, st = self._conn, self._st
        if st.reset or st.out or conn._write_paused:
            return False
        if not data or self._head:
            return True
        h2c = conn._h2
        if len(data) > min(h2c.local_flow_control_window(st.id), h2c.max_outbound_frame_size):
            return False
        h2c.send_data(st.id, data, end_stream=False)
        conn._schedule_flush()
        return True

    def end(self, trailers: Headers | None = None) -> None:
        st = self._st
        if not self._ending() or st.reset:
            return
        st.out_end = True
        st.trailers = trailers or None
        if not st.out:
            self._conn._end_stream(st)

    def abort(self) -> None:
        self.started = self.ended = True
        self._conn._reset(self._st, ErrorCodes.INTERNAL_ERROR)
