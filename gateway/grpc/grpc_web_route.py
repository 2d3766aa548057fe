"""gRPC-Web on the HTTP listeners (h1, h2, h3): the route and its calls on the call core.

The one piece the HTTP side needs: :meth:`GrpcWebRoute.matches` picks the
requests (a gRPC-Web content type, or a CORS preflight for a gRPC method) and
calling the route answers them on the adapter's ``ResponseSink`` through
:func:`serve_web_call`, which runs the call on the shared call core
(:func:`~gateway.grpc.call_core.run_call`) with a :class:`WebStream`, whose
status is the trailer frame in the body. The request body is read
through ``Request.stream`` where the adapter streams it (full duplex: bidi
``Chat`` over HTTP/2 and HTTP/3), else it is the one ``Request.body`` (turns
sent at once, replies streamed: what HTTP/1.1 browsers can do).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from grpclib.const import Handler
from grpclib.metadata import Deadline

from ..http.common import HttpLimits
from ..http.types import Request, ResponseSink
from .call_core import CallSink, GrpcStream, request_body, run_call, write_or_cut
from .compression import Codecs
from .cors import preflight_headers, response_headers
from .grpc_web import Rejection, WebCall, is_grpc_web, open_call
from .status import Status

__all__ = ["GrpcWebRoute", "WebStream", "serve_web_call"]


class _SinkAdapter:
    """``CallSink`` over an HTTP ``ResponseSink`` (HTTP 200, CORS headers added; a client that reads
    nothing for ``write_timeout`` is cut off: :func:`~gateway.grpc.call_core.write_or_cut`)."""

    def __init__(self, sink: ResponseSink, extra: list[tuple[bytes, bytes]], write_timeout: float | None) -> None:
        self._sink = sink
        self._extra = extra
        self._write_timeout = write_timeout

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._sink.start(200, headers + self._extra)

    async def write(self, data: bytes) -> None:
        await write_or_cut(self._sink, data, self._write_timeout)


class WebStream(GrpcStream):
    """One gRPC-Web call: the status is the trailer frame, in the body."""

    def __init__(self, call: WebCall, request_type: Any, body: AsyncIterator[bytes], sink: CallSink,
                 deadline: Deadline | None, headers: Mapping[bytes, bytes]) -> None:
        super().__init__(call.reader, call.writer, request_type, body, sink, deadline, headers)
        self._web = call.writer

    async def _end(self, status: Status, message: str, metadata: Sequence[tuple[str, str]]) -> None:
        await self._sink.write(self._web.trailers(status, message, metadata))


async def serve_web_call(handlers: Mapping[str, Handler], path: str, headers: Mapping[bytes, bytes],
                         body: AsyncIterator[bytes], sink: CallSink, codecs: Codecs, max_message: int,
                         stall_timeout: float | None = None) -> None:
    """Run one gRPC-Web call to its trailer frame (headers: lower-case names)."""
    opened = open_call(headers, codecs, max_message)
    if isinstance(opened, Rejection):
        await sink.start(opened.writer.headers())
        await sink.write(opened.writer.trailers(opened.status, opened.message))
        return

    def stream(request_type: Any, deadline: Deadline | None) -> GrpcStream:
        s = WebStream(opened, request_type, body, sink, deadline, headers)
        s.stall_timeout = stall_timeout
        return s

    await run_call(handlers, path, headers, stream)


class GrpcWebRoute:
    """``stall_timeout``: how long a streamed body may stall inside a message; ``write_timeout``: how
    long a client may read nothing (None: no bound); see :mod:`.call_core`."""

    def __init__(self, handlers: Mapping[str, Handler], codecs: Codecs, max_message: int,
                 allowed_origins: Collection[bytes] | None = None,
                 stall_timeout: float = HttpLimits().body_timeout, write_timeout: float | None = None) -> None:
        self._handlers = handlers
        self._write_timeout = write_timeout
        self._stall = stall_timeout
        self._codecs = codecs
        self._max_message = max_message
        self._origins = allowed_origins

    def matches(self, request: Request) -> bool:
        if request.method == "OPTIONS":
            return request.path in self._handlers and request.header(b"access-control-request-method") is not None
        return is_grpc_web(request.header(b"content-type", b"") or b"")

    def streams_body(self, request: Request) -> bool:
        """A call's body is read as it arrives where the adapter can (full duplex: HTTP/2, HTTP/3)."""
        return request.method == "POST" and is_grpc_web(request.header(b"content-type", b"") or b"")

    async def __call__(self, request: Request, sink: ResponseSink) -> None:
        origin = request.header(b"origin")
        if request.method == "OPTIONS":
            sink.respond(204, preflight_headers(origin, self._origins), b"")
            return
        if request.method != "POST":
            sink.respond(405, [(b"allow", b"POST, OPTIONS")], b"")
            return
        out = _SinkAdapter(sink, response_headers(origin, self._origins), self._write_timeout)
        await serve_web_call(self._handlers, request.path, dict(request.headers), request_body(request), out,
                             self._codecs, self._max_message, self._stall)
        sink.end()
