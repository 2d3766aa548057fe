"""HTTP/1.1 over httptools (llhttp), with h2c prior-knowledge and ALPN hand-off.

How it works: httptools calls us back per message piece (url, header, body,
complete). A completed message becomes a :class:`Request`; the connection runs
one handler task at a time and keeps later (pipelined) requests in a FIFO, so
responses leave in request order and never interleave. A protocol-level error
(400/408/413/431) is queued in the same FIFO as a pre-rendered response; once it
reaches the head it is written with ``connection: close``, the write side is
shut and input is drained for ``linger_timeout`` so the client reads the error
instead of a reset.

Header rules llhttp leaves to us are checked as headers arrive, at C speed: exactly one
Host (none is fine in HTTP/1.0) with a valid value, else 400 (RFC 9112 3.2); a transfer
coding other than ``chunked`` is a 501 (RFC 9112 6.1) -- ``chunked`` missing, not last or
twice is llhttp's 400 (6.3). Both end the connection after the error like any other
protocol error: the message framing may be sound, but a client that disagrees with us
about the message (a smuggling shape behind a proxy) may disagree about what follows.

Reading is never paused while a handler runs (so a client that goes away is
noticed and its handler cancelled). Once ``max_pipelined`` requests are waiting,
later input is held unparsed while reading goes on (a close is still seen), and
reading pauses only when that held input passes 64 KiB. While it is paused the
socket is polled for the client's FIN or RST every quarter second (what nginx
learns from EPOLLRDHUP): unread pipelined bytes must not hide a client that left. One lazy timer per
connection enforces header, body-stall and keep-alive deadlines: moving a
deadline later costs nothing, the timer re-arms itself when it fires early.

Output is coalesced: writes go to a list that is flushed once per loop
iteration (or early past 64 KiB, so backpressure is seen).
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from http import HTTPStatus
from math import inf
from typing import NoReturn, cast

import httptools

from gateway.errors import APIError, render_json
from gateway.http.common import (
    ERROR_HEADERS,
    HOST_CHARS,
    ClientDisconnected,
    ServerState,
    decode_target,
    error_body,
    http_date,
    run_request,
    spawn,
)
from gateway.http.types import Call, Headers, Request

__all__ = ["H1Protocol", "H2_PREFACE"]

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_IDLE, _HEADERS, _BODY = 0, 1, 2
_FLUSH_EARLY = 64 << 10
_HOLD_MAX = 64 << 10  # unparsed input held while the pipeline is full, before reading pauses
_WATCH_EVERY = 0.25  # while reading is paused: how often to look for the client's FIN or RST
_PEER_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)  # RDHUP: Linux
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


class _Stop(Exception):
    """Raised inside a parser callback to abandon the message."""


class _Queued:
    __slots__ = ("request", "keep_alive", "http10", "error")

    def __init__(self, request: Request | None, keep_alive: bool, http10: bool, error: bytes | None) -> None:
        self.request = request
        self.keep_alive = keep_alive
        self.http10 = http10
        self.error = error


class H1Protocol(asyncio.Protocol):
    """One HTTP/1.1 connection (switches itself to h2 on preface or ALPN ``h2``)."""

    def __init__(self, state: ServerState, *, tls: bool = False) -> None:
        self._srv = state
        self._limits = state.limits
        self._tls = tls
        self._scheme = "https" if tls else "http"
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._client: tuple[str, int] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._sniff: bytes | None = b""  # bytes seen while checking for the h2c preface
        self._now = 0.0
        # message being parsed
        self._pstate = _IDLE
        self._msg_seq = 0
        self._url = b""
        self._headers: Headers = []
        self._hdr_bytes = 0
        self._hdr_raw = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._content_length = -1
        self._chunked = False
        self._upgrade_left = 0
        self._expect = False
        self._continue_pending = False
        self._method = ""
        self._path = ""
        self._query = ""
        self._hosts = 0
        self._fail_with: tuple[int, str, str | None] | None = None
        # requests
        self._queue: deque[_Queued] = deque()
        self._active: _H1Sink | None = None
        self._task: Call | None = None  # the running handler: an asyncio.Task, or a fast-path Call
        self._input_closed = False
        self._closing = False
        self._held: bytearray | None = None  # input not parsed while max_pipelined requests wait
        self._reading_paused = False
        self._watch: asyncio.TimerHandle | None = None  # while reading is paused: _watch_peer
        # output
        self._out: list[bytes] = []
        self._out_size = 0
        self._flush_scheduled = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # timer
        self._deadline = inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = inf

    # ---- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
        if self._tls:
            self._sniff = None
            ssl_obj = transport.get_extra_info("ssl_object")
            if ssl_obj is not None and ssl_obj.selected_alpn_protocol() == "h2":
                self._switch_to_h2(b"")
                return
        self._srv.connections.add(self)
        self._now = self._loop.time()
        self._set_deadline(self._now + self._limits.keepalive_timeout)

    def data_received(self, data: bytes) -> None:
        if self._sniff is not None:
            buf = self._sniff + data if self._sniff else data
            n = min(len(buf), len(H2_PREFACE))
            if buf[:n] == H2_PREFACE[:n]:
                if n < len(H2_PREFACE):
                    self._sniff = buf
                else:
                    self._switch_to_h2(buf)
                return
            self._sniff = None
            data = buf
        if self._upgrade_left:
            self._now = self._loop.time()
            self._upgrade_body(data)
            return
        if self._input_closed:
            return
        if self._held is not None:
            self._hold(data)
            return
        self._now = self._loop.time()
        seq = self._msg_seq
        was_headers = self._pstate == _HEADERS
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # We do not switch protocols on Upgrade (h2c upgrade, websocket): the
            # request is answered as HTTP/1.1 and the connection then closes.
            self._input_closed = True
            if self._upgrade_left:
                self._upgrade_body(data[int(exc.args[0]) :])
            return
        except httptools.HttpParserError as exc:
            fail, self._fail_with = self._fail_with, None
            if fail is None:
                fail = (400, f"malformed HTTP request: {exc}", None)
            self._protocol_error(*fail)
            return
        if was_headers and self._pstate == _HEADERS and seq == self._msg_seq:
            self._hdr_raw += len(data)  # httptools buffers a header until it ends
            if self._hdr_raw > self._limits.max_header_bytes:
                self._protocol_error(431, "request headers too large")

    def eof_received(self) -> bool | None:
        return None  # a client that closes its side is gone: close, cancel its handler

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._srv.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._task is not None:
            self._task.cancel()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.cancel()
        self._queue.clear()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None:
            self._drain_waiter = None
            if not w.done():
                w.set_result(None)

    # ---- server control ---------------------------------------------------
    def drain(self) -> None:
        """Stop accepting: close now if idle, else after the current response."""
        if self._active is None and not self._queue and self._pstate == _IDLE:
            self._close_after_flush()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ---- httptools callbacks ----------------------------------------------
    def on_message_begin(self) -> None:
        self._pstate = _HEADERS
        self._msg_seq += 1
        self._url = b""
        self._headers = []
        self._hdr_bytes = self._hdr_raw = 0
        self._body = []
        self._body_len = 0
        self._content_length = -1
        self._chunked = False
        self._upgrade_left = 0
        self._expect = False
        self._hosts = 0
        self._set_deadline(self._now + self._limits.header_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self._limits.max_header_bytes:
            self._stop(431, "request target and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdr_bytes += len(name) + len(value) + 4
        if self._hdr_bytes > self._limits.max_header_bytes:
            self._stop(431, "request headers too large")
        name = name.lower()
        if name == b"host":
            self._hosts += 1
            if value.translate(None, HOST_CHARS):  # anything left is not uri-host [":" port]
                self._stop(400, "invalid Host header")
        if not value.isascii():
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                self._stop(400, "invalid UTF-8 in request header")
        if name == b"content-length":
            try:
                self._content_length = int(value)
            except ValueError:
                self._stop(400, "invalid content-length")
            if self._content_length > self._limits.max_body_bytes:
                self._stop(413, f"request body exceeds {self._limits.max_body_bytes} bytes")
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        elif name == b"transfer-encoding":
            self._chunked = True  # llhttp has checked it is valid (chunked last)
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._hosts != 1:
            if self._hosts:
                self._stop(400, "more than one Host header")
            if self._parser.get_http_version() != "1.0":
                self._stop(400, "HTTP/1.1 request without a Host header")
        if self._chunked:
            self._check_codings()
        raw_path, _, raw_query = self._url.partition(b"?")
        if not raw_path.startswith(b"/"):
            if raw_path == b"*":
                pass
            else:  # absolute-form (proxy style): keep only the path
                try:
                    url = httptools.parse_url(self._url)
                except httptools.HttpParserInvalidURLError:
                    self._stop(400, "invalid request target")
                raw_path, raw_query = url.path or b"/", url.query or b""
        try:
            self._path = decode_target(raw_path)
            self._query = raw_query.decode("utf-8")
        except UnicodeDecodeError:
            self._stop(400, "invalid UTF-8 in request target")
        self._method = self._parser.get_method().decode("ascii")
        self._pstate = _BODY
        self._set_deadline(self._now + self._limits.body_timeout)
        if self._expect and self._parser.get_http_version() == "1.1":
            if self._active is None and not self._queue:
                self._write(_CONTINUE)
            else:
                self._continue_pending = True

    def _check_codings(self) -> None:
        """llhttp accepts any codings before a final ``chunked`` and hands the body over still
        coded; we decode none of them."""
        codings = [
            c.split(b";", 1)[0].strip(b" \t").lower()
            for k, v in self._headers
            if k == b"transfer-encoding"
            for c in v.split(b",")
        ]
        codings = [c for c in codings if c]
        if codings[-1:] != [b"chunked"] or codings.count(b"chunked") > 1:
            self._stop(400, "transfer-encoding must end in chunked, once")  # RFC 9112 6.3
        if len(codings) > 1:
            self._stop(
                501,
                f"transfer-coding {codings[0].decode('ascii', 'replace')!r} is not supported; "
                "send the body with chunked alone or with content-length",
                "unsupported_transfer_encoding",
            )

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            self._stop(413, f"request body exceeds {self._limits.max_body_bytes} bytes")
        self._body.append(body)
        self._deadline = self._now + self._limits.body_timeout  # later: the lazy timer copes

    def on_message_complete(self) -> None:
        if (
            (self._content_length > 0 or self._chunked)
            and not self._body_len
            and self._parser.should_upgrade()
        ):
            # llhttp hands everything after an Upgrade request's headers to the
            # "new protocol", body included. We never upgrade (RFC 9110 lets a
            # server ignore it), so read a declared body ourselves.
            if self._chunked:
                self._stop(400, "chunked body on an Upgrade request is not supported")
            self._upgrade_left = self._content_length
            return
        self._complete(self._parser.should_keep_alive() and not self._parser.should_upgrade())

    def _complete(self, keep_alive: bool) -> None:
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        request = Request(
            self._method, self._path, self._query, self._headers, body, "http/1.1", self._scheme, self._client
        )
        http10 = self._parser.get_http_version() == "1.0"
        self._pstate = _IDLE
        self._deadline = inf
        self._continue_pending = False
        if not keep_alive:
            self._input_closed = True
        if self._active is None and not self._queue:
            self._start(request, keep_alive, http10)
        else:
            self._queue.append(_Queued(request, keep_alive, http10, None))
            if len(self._queue) >= self._limits.max_pipelined and self._held is None:
                self._held = bytearray()

    def _upgrade_body(self, data: bytes) -> None:
        take = data[: self._upgrade_left]
        if take:
            self._body.append(take)
            self._body_len += len(take)
            self._upgrade_left -= len(take)
            self._deadline = self._now + self._limits.body_timeout
        if not self._upgrade_left:
            self._complete(False)

    # ---- requests ---------------------------------------------------------
    def _stop(self, status: int, message: str, code: str | None = None) -> NoReturn:
        self._fail_with = (status, message, code)
        raise _Stop(message)

    def _start(self, request: Request, keep_alive: bool, http10: bool) -> None:
        sink = _H1Sink(self, request.method == "HEAD", keep_alive, http10)
        self._active = sink
        self._srv.request_started()
        fast = self._srv.fast
        if fast is not None:
            call = fast(request, sink, self._call_done)
            if call is not None:
                self._task = call
                return
        task = spawn(self._loop, run_request(self._srv.handler, request, sink))
        self._task = task
        task.add_done_callback(self._task_done)

    def _call_done(self) -> None:
        self._task_done(None)

    def _task_done(self, task: asyncio.Task[None] | None) -> None:
        self._srv.request_done()
        sink, self._active, self._task = self._active, None, None
        if self._transport is None or self._closing or sink is None:
            return
        if not sink.keep_alive or self._srv.draining:
            self._close_after_flush()
            return
        self._next()

    def _next(self) -> None:
        if self._queue:
            item = self._queue.popleft()
            if item.error is not None:
                self._write_error(item.error)
            else:
                assert item.request is not None
                self._start(item.request, item.keep_alive, item.http10)
            if self._held is not None and len(self._queue) < self._limits.max_pipelined:
                self._release_held()  # after the start: what it parses queues behind this request
            return
        if self._input_closed:
            self._close_after_flush()
        elif self._pstate == _IDLE:
            self._set_deadline(self._loop.time() + self._limits.keepalive_timeout)
        elif self._continue_pending:
            self._continue_pending = False
            self._write(_CONTINUE)

    def _hold(self, data: bytes) -> None:
        held = self._held
        assert held is not None
        held += data
        if len(held) > _HOLD_MAX and not self._reading_paused and self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True
            self._watch = self._loop.call_later(_WATCH_EVERY, self._watch_peer)

    def _watch_peer(self) -> None:
        """Reading is paused: close (as on EOF, cancelling the running request) once the kernel
        says the client shut its side or reset, though its unread bytes are still queued."""
        self._watch = None
        t = self._transport
        if t is None or not self._reading_paused:
            return
        sock = t.get_extra_info("socket")
        if sock is not None:
            poller = select.poll()
            poller.register(sock.fileno(), _PEER_GONE)
            if poller.poll(0):
                t.close()
                return
        self._watch = self._loop.call_later(_WATCH_EVERY, self._watch_peer)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
        if held and self._transport is not None:
            self.data_received(bytes(held))

    def _protocol_error(self, status: int, message: str, code: str | None = None) -> None:
        self._srv.report(status, "http/1.1", message)
        self._input_closed = True
        self._deadline = inf
        response = _error_response(status, message, code)
        if self._active is None and not self._queue:
            self._write_error(response)
        else:
            self._queue.append(_Queued(None, False, False, response))

    def _write_error(self, response: bytes) -> None:
        self._write(response)
        self._closing = True
        self._flush()
        t = self._transport
        if t is None:
            return
        if t.can_write_eof():
            t.write_eof()
        self._input_closed = True
        self._set_deadline(self._loop.time() + self._limits.linger_timeout)

    # ---- timer ------------------------------------------------------------
    def _set_deadline(self, when: float) -> None:
        self._deadline = when
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = inf
        if self._transport is None:
            return
        if self._deadline > self._loop.time():
            if self._deadline != inf:
                self._set_deadline(self._deadline)
            return
        if self._closing:
            self._transport.close()
        elif self._pstate == _HEADERS:
            self._protocol_error(408, "timed out reading request headers")
        elif self._pstate == _BODY:
            self._protocol_error(408, "timed out waiting for request body")
        elif self._active is None and not self._queue:
            self._close_after_flush()  # keep-alive idle timeout

    # ---- output -----------------------------------------------------------
    def _write(self, data: bytes) -> None:
        if self._transport is None:
            return
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size > _FLUSH_EARLY:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _write_now(self, data: bytes) -> None:
        """A whole response: out at once (a loop iteration sooner, one callback less), after
        anything already queued."""
        if self._out:
            self._write(data)
            self._flush()
        elif self._transport is not None:
            self._transport.write(data)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out or self._transport is None:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._out_size = 0
        self._transport.write(data)

    async def _drain(self) -> None:
        if self._transport is None:
            raise ClientDisconnected("client disconnected")
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()
        await self._drain_waiter

    def _close_after_flush(self) -> None:
        self._closing = True
        self._flush()
        if self._transport is not None:
            self._transport.close()

    def _switch_to_h2(self, preface: bytes) -> None:
        from gateway.http.h2 import H2Protocol

        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._srv.connections.discard(self)
        proto = H2Protocol(self._srv, tls=self._tls)
        self._transport.set_protocol(proto)
        proto.connection_made(self._transport)
        if preface:
            proto.data_received(preface)


def _error_response(status: int, message: str, code: str | None) -> bytes:
    body = error_body(status, message, code)
    return b"".join(
        (
            _status_line(status),
            b"date: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (http_date(), len(body)),
            body,
        )
    )


class _H1Sink:
    """:class:`ResponseSink` for one HTTP/1.1 request."""

    __slots__ = ("_conn", "_head", "keep_alive", "_http10", "started", "ended", "_chunked")

    def __init__(self, conn: H1Protocol, head: bool, keep_alive: bool, http10: bool) -> None:
        self._conn = conn
        self._head = head
        self.keep_alive = keep_alive
        self._http10 = http10
        self.started = False
        self.ended = False
        self._chunked = False

    def _head_block(self, status: int, headers: Headers, framing: bytes) -> list[bytes]:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        if self._conn._srv.draining:
            self.keep_alive = False
        buf = [_status_line(status), b"date: ", http_date(), b"\r\n"]
        for k, v in headers:
            buf += (k, b": ", v, b"\r\n")
        buf.append(framing)
        if not self.keep_alive:
            buf.append(b"connection: close\r\n\r\n")
        elif self._http10:
            buf.append(b"connection: keep-alive\r\n\r\n")
        else:
            buf.append(b"\r\n")
        return buf

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._respond(status, headers, body)

    def respond_nowait(self, status: int, headers: Headers, body: bytes) -> None:
        """:meth:`respond` without a coroutine (for :data:`gateway.http.types.FastHandler` calls)."""
        self._respond(status, headers, body)

    def _respond(self, status: int, headers: Headers, body: bytes) -> None:
        buf = self._head_block(status, headers, b"content-length: %d\r\n" % len(body))
        if body and not self._head:
            buf.append(body)
        self.ended = True
        self._conn._write_now(b"".join(buf))

    async def start(self, status: int, headers: Headers) -> None:
        if self._http10:  # no chunked coding in 1.0: the body ends at close
            self.keep_alive = False
            framing = b""
        else:
            self._chunked = True
            framing = b"transfer-encoding: chunked\r\n"
        self._conn._write(b"".join(self._head_block(status, headers, framing)))

    async def send(self, data: bytes) -> None:
        if not self.started or self.ended:
            raise RuntimeError("send() outside start()..end()")
        if not data or self._head:
            return
        conn = self._conn
        if self._chunked:
            conn._write(b"%x\r\n" % len(data))
            conn._write(data)
            conn._write(b"\r\n")
        else:
            conn._write(data)
        if conn._write_paused or conn._transport is None:
            await conn._drain()

    def send_nowait(self, data: bytes) -> bool:
        """Optional fast path of :meth:`send` for push-style producers: write ``data`` now if that
        needs no waiting and return True; return False, writing nothing, while the client is not
        reading (or is gone) -- the caller then awaits :meth:`send` with the same data."""
        if not self.started or self.ended:
            raise RuntimeError("send_nowait() outside start()..end()")
        conn = self._conn
        t = conn._transport
        if conn._write_paused or t is None:
            return False
        if data and not self._head:
            if self._chunked:
                data = b"%x\r\n%b\r\n" % (len(data), data)
            if conn._out:
                conn._write(data)  # a flush is pending: stay in order behind it
            else:
                t.write(data)  # nothing buffered: one chunk per producer step, no flush callback
        return True

    async def end(self) -> None:
        self._end()

    def _end(self) -> None:
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.ended:
            return
        self.ended = True
        if self._chunked and not self._head:
            self._conn._write(b"0\r\n\r\n")

    def fail(self, err: APIError) -> None:
        if not self.started:
            headers = ERROR_HEADERS
            if err.retry_after is not None:
                headers = [*headers, (b"retry-after", b"%d" % max(0, round(err.retry_after)))]
            self._respond(err.status, headers, render_json(err))
        elif not self.ended:  # bytes are out: cut the stream so the client sees it broke
            self.ended = True
            self.keep_alive = False

    def finish(self) -> None:
        if not self.started:
            self.fail(APIError(500, "handler returned without a response", "server_error"))
        elif not self.ended:
            self._end()
