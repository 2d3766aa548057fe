"""HTTP/1.1 adapter: feeds :class:`~gateway.http.h1_core.H1Core`, owns the transport.

How it works: bytes go to the core; each :class:`RequestReceived` goes to the one entrance
when nothing is ahead of it, else into a FIFO (pipelining), so responses leave in request
order and never interleave. A :class:`Rejected` waits in the same FIFO as a pre-rendered
response; once it reaches the head it is written with ``connection: close``, the write side
is shut and input is drained for ``linger_timeout`` so the client reads the error instead of
a reset. The connection hands itself to :class:`~gateway.http.h2.H2Protocol` when the first
bytes are the HTTP/2 preface or TLS negotiated ``h2``.

Reading is never paused while a request runs (so a client that goes away is noticed and its
call cancelled). Once ``max_pipelined`` requests are waiting, later input is held unparsed
while reading goes on (a close is still seen), and reading pauses only when that held input
passes 64 KiB. While it is paused the socket is polled for the client's FIN or RST every
quarter second (what nginx learns from EPOLLRDHUP): unread pipelined bytes must not hide a
client that left. One lazy timer enforces the core's header and body-stall deadlines and the
keep-alive and linger ones.

Output is coalesced: writes go to a list flushed once per loop iteration (or early past 64
KiB, so backpressure is seen); a whole response with nothing queued is written at once.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque

from gateway.http import h1_core as wire
from gateway.http.adapter import SinkState, StreamAdapter
from gateway.http.common import ServerState, http_date
from gateway.http.h1_core import H1Core, Rejected, RequestReceived
from gateway.http.types import Call, Headers, Request

__all__ = ["H1Protocol", "H2_PREFACE"]

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FLUSH_EARLY = 64 << 10
_HOLD_MAX = 64 << 10  # unparsed input held while the pipeline is full, before reading pauses
_WATCH_EVERY = 0.25  # while reading is paused: how often to look for the client's FIN or RST
_PEER_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)  # RDHUP: Linux


class H1Protocol(StreamAdapter):
    """One HTTP/1.1 connection (switches itself to h2 on preface or ALPN ``h2``)."""

    def __init__(self, state: ServerState, *, tls: bool = False) -> None:
        super().__init__(state, tls=tls)
        self._core = H1Core(state.limits, scheme=self._scheme)
        self._sniff: bytes | None = b""  # bytes seen while checking for the h2c preface
        self._queue: deque[RequestReceived | bytes] = deque()  # waiting: requests, rendered errors
        self._active: _H1Sink | None = None
        self._call: Call | None = None
        self._continue_pending = False
        self._closing = False
        self._held: bytearray | None = None  # input not parsed while max_pipelined requests wait
        self._reading_paused = False
        self._watch: asyncio.TimerHandle | None = None  # while reading is paused: _watch_peer
        self._out: list[bytes] = []
        self._out_size = 0

    # ---- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self._attach(transport, register=False)
        self._core.client = self._client
        if self._tls:
            self._sniff = None
            ssl_obj = t.get_extra_info("ssl_object")
            if ssl_obj is not None and ssl_obj.selected_alpn_protocol() == "h2":
                self._switch_to_h2(b"")
                return
        self._srv.connections.add(self)
        self._set_deadline(self._loop.time() + self._limits.keepalive_timeout)

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
        if self._held is not None:
            self._hold(data)
            return
        core = self._core
        events = core.receive(data, self._loop.time())
        if self._closing:
            return  # lingering after an error response: only the linger deadline counts
        if core.deadline < self._timer_at:
            self._set_deadline(core.deadline)
        else:
            self._deadline = core.deadline  # later (or none): the lazy timer copes
        for ev in events:
            if type(ev) is RequestReceived:
                if self._active is None and not self._queue:
                    self._start(ev)
                else:
                    self._queue.append(ev)
                    if len(self._queue) >= self._limits.max_pipelined and self._held is None:
                        self._held = bytearray()
            elif type(ev) is Rejected:
                self._reject(ev)
            elif self._active is None and not self._queue:  # ContinueExpected
                self._write(wire.CONTINUE)
            else:
                self._continue_pending = True

    def eof_received(self) -> bool | None:
        return None  # a client that closes its side is gone: close, cancel its request

    def _lost(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._call is not None:
            self._call.cancel()
        self._queue.clear()
        self._core.release()

    # ---- server control ---------------------------------------------------
    def drain(self) -> None:
        """Stop accepting: close now if idle, else after the current response."""
        if self._active is None and not self._queue and self._core.state == wire.IDLE:
            self._close_after_flush()

    # ---- requests ---------------------------------------------------------
    def _start(self, ev: RequestReceived) -> None:
        request: Request = ev.request
        self._continue_pending = False
        self._active = sink = _H1Sink(self, request.method == "HEAD", ev.keep_alive, ev.http10)
        self._srv.request_started()
        self._call = self._srv.entrance(request, sink, self._done)

    def _done(self) -> None:
        self._srv.request_done()
        sink, self._active, self._call = self._active, None, None
        if self._transport is None or self._closing or sink is None:
            return
        if not sink.keep_alive or self._srv.draining:
            self._close_after_flush()
        elif self._queue:
            item = self._queue.popleft()
            if isinstance(item, bytes):
                self._write_error(item)
            else:
                self._start(item)
            if self._held is not None and len(self._queue) < self._limits.max_pipelined:
                self._release_held()  # after the start: what it parses queues behind this request
        elif self._core.closed:
            self._close_after_flush()
        elif self._core.state == wire.IDLE:
            self._set_deadline(self._loop.time() + self._limits.keepalive_timeout)
        elif self._continue_pending:
            self._continue_pending = False
            self._write(wire.CONTINUE)

    def _reject(self, ev: Rejected) -> None:
        err = ev.error
        self._srv.report(err.status, "http/1.1", err.message)
        response = wire.error_response(err, http_date())
        if self._active is None and not self._queue:
            self._write_error(response)
        else:
            self._queue.append(response)

    def _write_error(self, response: bytes) -> None:
        self._write(response)
        self._closing = True
        self._flush()
        t = self._transport
        if t is None:
            return
        if t.can_write_eof():
            t.write_eof()
        self._set_deadline(self._loop.time() + self._limits.linger_timeout)

    # ---- holding pipelined input ------------------------------------------
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

    # ---- timer ------------------------------------------------------------
    def _deadline_passed(self) -> None:
        assert self._transport is not None
        if self._closing:
            self._transport.close()  # the linger after an error response is over
            return
        expired = self._core.expire(self._loop.time())
        if expired is not None:
            self._reject(expired)
        elif self._active is None and not self._queue and self._core.state == wire.IDLE:
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

    def _take_output(self) -> bytes:
        out = self._out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._out_size = 0
        return data

    def _close_after_flush(self) -> None:
        self._closing = True
        self._close()

    def _switch_to_h2(self, preface: bytes) -> None:
        from gateway.http.h2 import H2Protocol

        assert self._transport is not None
        self._stop_timer()
        self._srv.connections.discard(self)
        self._core.release()
        proto = H2Protocol(self._srv, tls=self._tls)
        self._transport.set_protocol(proto)
        proto.connection_made(self._transport)
        if preface:
            proto.data_received(preface)


class _H1Sink(SinkState):
    """:class:`~gateway.http.types.ResponseSink` for one HTTP/1.1 request."""

    __slots__ = ("_conn", "keep_alive", "_http10", "_chunked")

    def __init__(self, conn: H1Protocol, head: bool, keep_alive: bool, http10: bool) -> None:
        self._head = head  # SinkState's fields, set here: one call less per request
        self.started = self.ended = False
        self._conn = conn
        self.keep_alive = keep_alive
        self._http10 = http10
        self._chunked = False

    def _head_block(self, status: int, headers: Headers, framing: bytes) -> list[bytes]:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        if self._conn._srv.draining:
            self.keep_alive = False
        if not self.keep_alive:
            end = wire.CLOSE
        else:
            end = wire.KEEP_ALIVE if self._http10 else wire.END_HEAD
        extra = self._conn._srv.extra_headers
        return wire.response_head(status, [*headers, *extra] if extra else headers, http_date(), framing, end)

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        buf = self._head_block(status, headers, b"content-length: %d\r\n" % len(body))
        if body and not self._head:
            buf.append(body)
        self.ended = True
        self._conn._write_now(b"".join(buf))

    def start(self, status: int, headers: Headers) -> None:
        if self._http10:  # no chunked coding in 1.0: the body ends at close
            self.keep_alive = False
            framing = b""
        else:
            self._chunked = True
            framing = wire.CHUNKED
        self._conn._write(b"".join(self._head_block(status, headers, framing)))

    async def send(self, data: bytes) -> None:
        self._in_body("send")
        conn = self._conn
        if data and not self._head:
            if self._chunked:
                conn._write(wire.chunk_head(len(data)))
                conn._write(data)
                conn._write(b"\r\n")
            else:
                conn._write(data)
        if conn._write_paused or conn._transport is None:
            await conn._drain()

    def send_nowait(self, data: bytes) -> bool:
        if not self.started or self.ended:  # _in_body, inline: once per engine step of every stream
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

    def end(self, trailers: Headers | None = None) -> None:
        if self._ending() and self._chunked and not self._head:
            conn = self._conn
            t = conn._transport
            if conn._out or t is None:
                conn._write(wire.LAST_CHUNK)  # behind what is queued (or dropped: the client is gone)
            else:  # a stream's last chunk went out from send_nowait: end it now, not a loop iteration later
                t.write(wire.LAST_CHUNK)

    def abort(self) -> None:
        """Cut the response: the connection closes once the call is done, without the last
        chunk (or, for an unframed 1.0 body, before the length the client may expect)."""
        self.started = self.ended = True
        self.keep_alive = False
