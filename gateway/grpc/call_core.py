"""The gRPC call core native gRPC and gRPC-Web both run on: the thin asyncio layer over the
sans-I/O cores (:mod:`.grpc_web`, :mod:`.native`).

How it works: a route (:mod:`.native_route` on the gRPC port, :mod:`.grpc_web_route` on the
HTTP listeners) opens the call (codec negotiation) and hands :func:`run_call` the request path
and headers and a factory of its :class:`GrpcStream`. :func:`run_call` finds the handler in a
grpclib ``__mapping__()`` table -- the same handlers for both -- and runs it on the stream,
which feeds body chunks (an async iterator) to the sans-I/O reader only when the handler asks
for a message (so a bidi ``Chat`` over HTTP/2 or HTTP/3 reads turns while it streams replies)
and writes replies through a :class:`CallSink`. Whatever happens -- a malformed body, an unknown
method, an expired ``grpc-timeout``, a handler bug, a body the adapter refused (413), a body
that stalls -- the response ends with exactly one status and nothing propagates into the
adapter; only a client that went away ends it without one. Each route's stream subclass says
where the status goes: gRPC-Web's is the trailer frame
(:class:`~gateway.grpc.grpc_web_route.WebStream`), native gRPC's HTTP trailers
(:class:`~gateway.grpc.native_route.NativeStream`).

A body that stalls: while a message is incomplete (part of a frame held, or the
one message of a unary-request method not yet come) each wait for more of the
body is bounded by ``stall_timeout`` (the listener's body timeout): past it the
call is DEADLINE_EXCEEDED, as a body read whole would be 408. Between the
messages of a streaming request (a Chat before and between turns) the client
may be idle as long as it likes.

A client that reads nothing: :func:`write_or_cut` waits for it at most the
route's ``write_timeout`` (``[api] write_timeout``, as for a streamed HTTP
response), then aborts the stream (RST) and ends the call as a client gone:
the handler's ``finally`` cancels its generation.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from grpclib.const import Handler
from grpclib.metadata import Deadline, decode_bin_value

from ..errors import APIError, internal_error
from ..http.common import ClientDisconnected
from ..http.types import Request, ResponseSink
from .grpc_web import CallFailed, MessageReceived, WebEvent, WebRequestReader
from .status import Status, grpc_status, parse_grpc_timeout

__all__ = ["CallSink", "MessageWriter", "GrpcStream", "run_call", "write_or_cut", "request_body", "call_metadata",
           "CallAborted", "request_message"]

log = logging.getLogger(__name__)


class CallSink(Protocol):
    """Where a call's response goes: HTTP 200 with ``headers``, then body bytes (each route wraps
    its adapter's ``ResponseSink`` in one)."""

    async def start(self, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def write(self, data: bytes) -> None: ...


async def write_or_cut(sink: ResponseSink, data: bytes, timeout: float | None) -> None:
    """``data`` to ``sink``: at once if it takes it, else awaited up to ``timeout`` seconds; a client
    that has read nothing that long is cut off (the stream aborted) as a :class:`ClientDisconnected`."""
    if sink.send_nowait(data):
        return
    if timeout is None:
        return await sink.send(data)
    try:
        async with asyncio.timeout(timeout):
            await sink.send(data)
    except TimeoutError:
        log.info("gRPC: the client read nothing for %g s; cutting the stream", timeout)
        sink.abort()
        raise ClientDisconnected(f"the client read nothing for {timeout:g} s") from None


def _binary(value: bytes) -> bytes:
    try:
        return decode_bin_value(value)
    except binascii.Error:  # not base64: the bytes as sent (metadata, not worth failing a call over)
        return value


def call_metadata(headers: Mapping[bytes, bytes], skip: frozenset[bytes] = frozenset()) -> dict[str, str | bytes]:
    """Call metadata as grpclib presents it: request headers but the pseudo and grpc-* ones and
    ``skip``, binary (-bin) values decoded to bytes."""
    return {k.decode("latin-1"): _binary(v) if k.endswith(b"-bin") else v.decode("latin-1")
            for k, v in headers.items() if not k.startswith((b":", b"grpc-")) and k not in skip}


async def request_body(request: Request) -> AsyncIterator[bytes]:
    """A call's body as chunks: read as it arrives (``Request.stream``) or the one body read whole."""
    if request.stream is None:
        if request.body:
            yield request.body
        return
    while chunk := await request.stream.read():
        yield chunk


class MessageWriter(Protocol):
    """The response side of a call's core: its HTTP headers and its message frames."""

    def headers(self) -> list[tuple[bytes, bytes]]: ...

    def message(self, payload: bytes) -> bytes: ...


class CallAborted(Exception):
    """The call ends with this status (raised inside a call core, caught where its status is sent)."""

    def __init__(self, status: Status, message: str) -> None:
        self.status = status
        self.message = message


def request_message(event: WebEvent, request_type: Any) -> Any:
    """The request message ``event`` carries, or None at the end of the requests; a frame the
    reader could not take, or a message that does not parse, is :class:`CallAborted`."""
    if isinstance(event, MessageReceived):
        try:
            return request_type.FromString(event.data)
        except DecodeError as e:
            raise CallAborted(Status.INTERNAL, f"cannot parse the request message: {e}") from None
    if isinstance(event, CallFailed):
        raise CallAborted(event.status, event.message)
    return None  # RequestEnded


class GrpcStream:
    """A :class:`~gateway.grpc.service.CallStream` over one call's reader, writer and sink; a
    subclass says how the status goes out (:meth:`_end`)."""

    #: request headers that are not call metadata (beside the pseudo and grpc-* ones)
    not_metadata: frozenset[bytes] = frozenset()
    #: seconds the body may stall inside a message (None: no bound); set by the route
    stall_timeout: float | None = None
    #: the method takes a stream of messages (set by :func:`run_call` from the handler)
    client_streaming = True

    def __init__(self, reader: WebRequestReader, writer: MessageWriter, request_type: Any,
                 body: AsyncIterator[bytes], sink: CallSink, deadline: Deadline | None,
                 headers: Mapping[bytes, bytes]) -> None:
        self.deadline = deadline
        self.metadata: Mapping[str, str | bytes] = call_metadata(headers, self.not_metadata)
        self._reader = reader
        self._writer = writer
        self._request_type = request_type
        self._body = body
        self._sink = sink
        self._events: deque[WebEvent] = deque()
        self._body_done = False
        self._received = False  # a message has come
        self._started = False
        self.finished = False  # the trailer frame has been written

    async def recv_message(self) -> Any:
        while not self._events:
            if self._body_done:
                return None
            try:
                chunk = await self._next_chunk()
            except APIError as e:  # the adapter refused the rest of the body (413), or it stalled
                raise CallAborted(grpc_status(e), e.message) from None
            if chunk is None:
                self._body_done = True
                self._events.extend(self._reader.end_of_stream())
            else:
                self._events.extend(self._reader.receive_data(chunk))
        event = self._events.popleft()
        if isinstance(event, MessageReceived):
            self._received = True
        message = request_message(event, self._request_type)
        if message is None:
            self._body_done = True  # RequestEnded
        return message

    async def _next_chunk(self) -> bytes | None:
        stall = self.stall_timeout
        inside_a_message = self._reader.pending or not (self.client_streaming or self._received)
        if stall is None or not inside_a_message:
            return await anext(self._body, None)
        try:
            async with asyncio.timeout(stall):
                return await anext(self._body, None)
        except TimeoutError:
            raise APIError(408, f"The request message stopped arriving ({stall:g} s without data).",
                           "invalid_request_error", None, "request_timeout") from None

    def __aiter__(self) -> AsyncIterator[Any]:
        """The request messages (grpclib's reflection service reads them this way)."""
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while (message := await self.recv_message()) is not None:
            yield message

    async def send_message(self, message: Any) -> None:
        await self._start()
        await self._sink.write(self._writer.message(message.SerializeToString()))

    async def send_trailing_metadata(self, *, status: Status = Status.OK, status_message: str | None = None,
                                     metadata: Sequence[tuple[str, str]] | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        await self._start()
        await self._end(status, status_message or "", metadata or ())

    async def _end(self, status: Status, message: str, metadata: Sequence[tuple[str, str]]) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        if not self._started:
            self._started = True
            await self._sink.start(self._writer.headers())


async def run_call(handlers: Mapping[str, Handler], path: str, headers: Mapping[bytes, bytes],
                   stream_for: Callable[[Any, Deadline | None], GrpcStream]) -> None:
    """Run the handler for ``path`` on the stream ``stream_for(request_type, deadline)`` makes, to its
    one status (grpc-timeout enforced); a client that went away ends it without one."""
    handler = handlers.get(path)
    timeout: float | None = None
    status, message = Status.OK, ""
    if handler is None:
        status, message = Status.UNIMPLEMENTED, f"unknown method {path}"
    elif (raw := headers.get(b"grpc-timeout")) is not None:
        try:
            timeout = parse_grpc_timeout(raw)
        except APIError as e:  # a malformed header is a protocol error, as grpc-go answers it
            status, message = Status.INTERNAL, e.message
    stream = stream_for(handler.request_type if handler else None,
                        Deadline.from_timeout(timeout) if timeout is not None else None)
    if handler is not None:
        stream.client_streaming = handler.cardinality.value.client_streaming
    if handler is not None and status is Status.OK:
        try:
            async with asyncio.timeout(timeout):
                await handler.func(stream)
        except CallAborted as a:
            status, message = a.status, a.message
        except TimeoutError:
            status, message = Status.DEADLINE_EXCEEDED, "Deadline exceeded"
        except ConnectionError:
            return  # the client went away (stream reset, connection lost): nobody to tell
        except Exception:
            log.exception("gRPC handler for %s failed", path)
            err = internal_error()
            status, message = grpc_status(err), err.message
    try:
        await stream.send_trailing_metadata(status=status, status_message=message)
    except ConnectionError:
        pass
