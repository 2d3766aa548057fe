"""Native gRPC calls on our own HTTP/2 adapter: the route the gRPC port serves.

How it works: the gRPC listener is an HTTP listener (h2c, prior knowledge) whose
entrance is a :class:`NativeRoute` and whose ``streams_body`` predicate takes
every request, so the HTTP/2 adapter hands each call over at HEADERS with its
body as ``Request.stream`` (acknowledged to the client as the handler reads it).
The route checks what makes a request a gRPC call (POST, HTTP/2, an
``application/grpc`` content type: else 405, 505, 415), opens the call
(:func:`~gateway.grpc.native.open_call`) and runs the same grpclib handlers as
gRPC-Web through :func:`~gateway.grpc.call_core.run_call` on a
:class:`NativeStream`, whose status goes in HTTP/2 trailers
(``ResponseSink.end(trailers)``). A client's RST_STREAM or lost connection
cancels the call's task (the adapter's ``call.cancel()``), and with it the
generation; ``grpc-timeout`` ends it with DEADLINE_EXCEEDED. (With the pipeline as backend,
``Generate`` does not come here: :mod:`.native_generate` answers it without a handler task.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from grpclib.const import Handler
from grpclib.metadata import Deadline

from ..http.types import Headers, Request, ResponseSink
from .call_core import GrpcStream, request_body, run_call, write_or_cut
from .compression import Codecs
from .native import NOT_METADATA, NativeCall, NativeRejection, NativeResponseWriter, is_grpc, open_call
from .status import Status

__all__ = ["NativeRoute", "NativeStream"]


class _Sink:
    """``CallSink`` over an HTTP/2 ``ResponseSink``: HTTP 200 with the call's headers, then frames
    (a client that reads nothing for ``write_timeout`` is cut off: :func:`write_or_cut`)."""

    def __init__(self, sink: ResponseSink, write_timeout: float | None) -> None:
        self.sink = sink
        self._write_timeout = write_timeout

    async def start(self, headers: Headers) -> None:
        self.sink.start(200, headers)

    async def write(self, data: bytes) -> None:
        await write_or_cut(self.sink, data, self._write_timeout)


class NativeStream(GrpcStream):
    """One native call: the status goes in HTTP/2 trailers."""

    not_metadata = NOT_METADATA

    def __init__(self, call: NativeCall, request_type: Any, body: AsyncIterator[bytes], sink: _Sink,
                 deadline: Deadline | None, headers: Mapping[bytes, bytes]) -> None:
        super().__init__(call.reader, call.writer, request_type, body, sink, deadline, headers)
        self._native = call.writer
        self._http = sink.sink

    async def _end(self, status: Status, message: str, metadata: Sequence[tuple[str, str]]) -> None:
        self._http.end(self._native.trailers(status, message, metadata))


def _refuse(sink: ResponseSink, status: int, why: str) -> None:
    sink.respond(status, [(b"content-type", b"text/plain; charset=utf-8")], why.encode())


class NativeRoute:
    """The gRPC port's handler: ``task_entrance(NativeRoute(...))`` is its entrance."""

    def __init__(self, handlers: Mapping[str, Handler], codecs: Codecs, max_message: int,
                 stall_timeout: float | None = None, write_timeout: float | None = None) -> None:
        self._handlers = handlers
        self._write_timeout = write_timeout
        self._stall = stall_timeout  # a body stalled inside a message (see gateway.grpc.call_core)
        self._codecs = codecs
        self._max_message = max_message

    def streams_body(self, request: Request) -> bool:
        """Every call reads its body as it arrives (client and bidi streaming)."""
        return True

    async def __call__(self, request: Request, sink: ResponseSink) -> None:
        if request.method != "POST":
            return _refuse(sink, 405, "gRPC calls are POST requests\n")
        if request.protocol != "h2":
            return _refuse(sink, 505, "gRPC needs HTTP/2 (h2c with prior knowledge on this port)\n")
        if not is_grpc(request.header(b"content-type", b"") or b""):
            return _refuse(sink, 415, "content-type must be application/grpc\n")
        headers = dict(request.headers)
        opened = open_call(headers, self._codecs, self._max_message)
        if isinstance(opened, NativeRejection):
            return _rejected(sink, opened.writer, opened.status, opened.message)
        out = _Sink(sink, self._write_timeout)
        body = request_body(request)

        def stream(request_type: Any, deadline: Deadline | None) -> GrpcStream:
            s = NativeStream(opened, request_type, body, out, deadline, headers)
            s.stall_timeout = self._stall
            return s

        await run_call(self._handlers, request.path, headers, stream)


def _rejected(sink: ResponseSink, writer: NativeResponseWriter, status: Status, message: str) -> None:
    sink.start(200, writer.headers())
    sink.end(writer.trailers(status, message))
