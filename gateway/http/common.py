"""What every protocol adapter shares: limits, the server-wide state, protocol errors,
and :func:`task_entrance`, which makes a coroutine route an :data:`~gateway.http.types.Entrance`.

The adapters (:mod:`gateway.http.h1`, :mod:`gateway.http.h2`) own parsing and framing; this
module owns the rules that must be the same for both: how in-flight requests are counted for
draining, how a protocol-level rejection (400/408/413/431/501) becomes an :class:`APIError`
(rendered by :mod:`gateway.errors` like every other error) and is reported to the optional
``on_event`` hook (metrics).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import urllib.parse
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Protocol

from gateway.errors import APIError, error_headers, internal_error, render_json
from gateway.http.types import Call, Entrance, Handler, Headers, Request, ResponseSink, StreamsBody

from .. import clock

__all__ = [
    "HttpLimits",
    "ProtocolEvent",
    "EventHook",
    "ServerState",
    "Connection",
    "ClientDisconnected",
    "task_entrance",
    "spawn",
    "protocol_error",
    "decode_target",
    "HOST_CHARS",
    "http_date",
]

log = logging.getLogger("gateway.http")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-connection and per-request limits shared by HTTP/1.1 and HTTP/2."""

    max_body_bytes: int = 1 << 20  # -> 413
    max_header_bytes: int = 16 << 10  # request line/pseudo-headers + headers -> 431
    header_timeout: float = 10.0  # first byte of a request to end of its headers -> 408
    body_timeout: float = 30.0  # longest gap between body bytes -> 408
    keepalive_timeout: float = 75.0  # idle connection, nothing in flight -> closed
    h2_max_concurrent_streams: int = 256
    h2_initial_window_size: int = 1 << 20  # per-stream receive window we advertise
    max_pipelined: int = 16  # parsed-but-unanswered h1 requests before reading pauses
    linger_timeout: float = 2.0  # after an error response, drain input this long before closing
    send_buffer: int = 0  # SO_SNDBUF of accepted sockets (0: the kernel's autotuning, up to MBs a client)
    # A body read as it arrives over HTTP/2 (Request.stream), in all; 0: max_body_bytes. What it holds
    # unread is bounded by flow control, so a long bidi call (the gRPC port) may lift this.
    max_streamed_body_bytes: int = 0

    @property
    def streamed_body_limit(self) -> int:
        return self.max_streamed_body_bytes or self.max_body_bytes

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "h2_max_concurrent_streams", "max_pipelined"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be >= 1")
        for name in ("header_timeout", "body_timeout", "keepalive_timeout", "linger_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HttpLimits.{name} must be > 0")
        if not 65535 <= self.h2_initial_window_size <= 2**31 - 1:
            raise ValueError("HttpLimits.h2_initial_window_size must be in [65535, 2**31-1]")


@dataclass(frozen=True, slots=True)
class ProtocolEvent:
    """A request that ended at the protocol layer and never reached the pipeline."""

    status: int  # 400, 408, 413, 431, 501
    protocol: str  # "http/1.1" | "h2"
    reason: str


EventHook = Callable[[ProtocolEvent], None]

# The bytes of a Host / :authority value (RFC 9110 7.2, RFC 3986 uri-host [":" port]): unreserved,
# pct-encoded, sub-delims, ":" and the brackets of an IP literal. ``value.translate(None,
# HOST_CHARS)`` leaves what does not belong (empty is a valid Host).
HOST_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~%!$&'()*+,;=:[]"


_CODES = {400: "invalid_request", 408: "request_timeout", 413: "request_too_large",
          431: "request_headers_too_large", 501: "not_implemented"}


def protocol_error(status: int, message: str, code: str | None = None) -> APIError:
    """The error of a request an adapter refuses itself (rendered by :mod:`gateway.errors`), with a
    code a client can branch on whatever protocol carried it."""
    return APIError(status, message, "server_error" if status >= 500 else "invalid_request_error", None,
                    code or _CODES.get(status))


_date_cache: list[Any] = [0, b""]


def http_date() -> bytes:
    """The ``date`` header value (RFC 9110 IMF-fixdate), rebuilt once a second."""
    now = int(clock.wall())
    if now != _date_cache[0]:
        _date_cache[0] = now
        _date_cache[1] = formatdate(now, usegmt=True).encode()
    value: bytes = _date_cache[1]
    return value


def decode_target(raw_path: bytes) -> str:
    """Percent-decode a request path; raises ``UnicodeDecodeError`` on bad UTF-8."""
    if b"%" in raw_path:
        raw_path = urllib.parse.unquote_to_bytes(raw_path)
    return raw_path.decode("utf-8")


class ClientDisconnected(ConnectionError):
    """The client went away (connection lost, stream reset) while we were writing."""


class Connection(Protocol):
    """What :class:`ServerState` needs from a live connection."""

    def drain(self) -> None: ...
    def abort(self) -> None: ...


class ServerState:
    """Server-wide bookkeeping shared by all connections of one listener."""

    __slots__ = ("entrance", "limits", "on_event", "in_flight", "draining", "connections", "_idle",
                 "extra_headers", "streams_body")

    def __init__(self, entrance: Entrance, limits: HttpLimits, on_event: EventHook | None,
                 extra_headers: Headers | None = None, streams_body: StreamsBody | None = None) -> None:
        self.entrance = entrance
        # which requests the entrance reads as their body arrives (HTTP/2: Request.stream); None: none
        self.streams_body = streams_body
        self.extra_headers: Headers = extra_headers or []  # on every response (Alt-Svc on TLS)
        self.limits = limits
        self.on_event = on_event
        self.in_flight = 0  # requests handed to the entrance whose done() has not come yet
        self.draining = False
        self.connections: set[Connection] = set()
        self._idle: list[asyncio.Future[None]] = []

    def request_started(self) -> None:
        self.in_flight += 1

    def request_done(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle:
            for fut in self._idle:
                if not fut.done():
                    fut.set_result(None)
            self._idle.clear()

    async def wait_idle(self) -> None:
        if self.in_flight == 0:
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle.append(fut)
        await fut

    def report(self, status: int, protocol: str, reason: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(ProtocolEvent(status, protocol, reason))
            except Exception:  # a metrics hook must never break serving
                log.exception("on_event hook failed")


if sys.version_info >= (3, 12):

    def spawn(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start a task eagerly: it runs up to its first real suspension right now, saving a
        loop iteration per request (done callbacks still run via ``call_soon``, so adapters
        see completion later, never re-entrantly)."""
        return asyncio.Task(coro, loop=loop, eager_start=True)

else:

    def spawn(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start a task (eager start needs Python 3.12)."""
        return loop.create_task(coro)


def task_entrance(handler: Handler) -> Entrance:
    """A coroutine route as an :data:`Entrance`: each request runs ``handler`` in a task.

    An :class:`APIError` raised before the response started is rendered by
    :mod:`gateway.errors`; any other exception is a 500; an exception after the start
    aborts the response; a handler that returns without responding gets a 500, one that
    returns mid-stream has its response ended. ``done()`` comes once, from the task's done
    callback (so never from inside the entrance call).
    """

    def entrance(request: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        tracked = _Tracked(sink, done)
        task = spawn(asyncio.get_running_loop(), _run(handler, request, tracked))
        task.add_done_callback(tracked.task_done)
        return task

    return entrance


async def _run(handler: Handler, request: Request, sink: _Tracked) -> None:
    try:
        await handler(request, sink)
    except ClientDisconnected:
        pass  # the adapter cancels the request or has reset its stream
    except APIError as err:
        sink.fail(err)
    except Exception:
        log.exception("handler failed: %s %s", request.method, request.path)
        sink.fail(internal_error())
    else:
        if not sink.started:  # a bug of ours: the client gets the one internal error, the log says which
            log.error("handler returned without a response: %s %s", request.method, request.path)
            sink.fail(internal_error())
        elif not sink.ended:
            sink.end()


class _Tracked:
    """The sink :func:`task_entrance` hands its handler: notes how far the response got."""

    __slots__ = ("_sink", "_done", "started", "ended")

    def __init__(self, sink: ResponseSink, done: Callable[[], None]) -> None:
        self._sink = sink
        self._done = done
        self.started = False
        self.ended = False

    def task_done(self, _: object) -> None:
        self._done()

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = self.ended = True
        self._sink.respond(status, headers, body)

    def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self._sink.start(status, headers)

    def send_nowait(self, data: bytes) -> bool:
        return self._sink.send_nowait(data)

    async def send(self, data: bytes) -> None:
        await self._sink.send(data)

    def end(self, trailers: Headers | None = None) -> None:
        self.ended = True
        self._sink.end(trailers)

    def abort(self) -> None:
        self.ended = True
        self._sink.abort()

    def fail(self, err: APIError) -> None:
        if not self.started:
            self.respond(err.status, error_headers(err), render_json(err))
        elif not self.ended:  # bytes are out: cut the response so the client sees it broke
            self.abort()
