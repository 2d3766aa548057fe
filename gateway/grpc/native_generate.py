"""Native gRPC ``Generate`` answered by the pipeline directly: no handler task, nothing woken per token.

How it works: the gRPC port's entrance is :class:`NativeEntrance`. A ``Generate`` call (server
streaming: its request is one message) is read -- by a short task that only waits for that one
message, bounded by the body stall timeout and ``grpc-timeout`` as the service's calls are -- and
then handed to the pipeline (:meth:`~gateway.grpc.pipeline_backend.PipelineBackend.start`: admission,
routing, the generation call) with a :class:`~gateway.grpc.native_frame_writer.GrpcFrameWriter` on the
call's own HTTP/2 sink. From there on it is written the way SSE is: each engine step's message
goes out from the transport's token callback (``send_nowait``), the status in the trailers the
call ends the sink with. The reading task has ended by then. Every other call (Chat, Complete,
ListModels, health, reflection), and anything that is not a gRPC call over HTTP/2, takes the
service path (:class:`~gateway.grpc.native_route.NativeRoute` in a task).

What stays as it was: ``grpc-encoding`` negotiation (UNIMPLEMENTED for an unknown one), the
message bounds (RESOURCE_EXHAUSTED), a malformed ``grpc-timeout`` (INTERNAL), the deadline (the
generation call's timeout; DEADLINE_EXCEEDED), RST_STREAM (``cancel()``: the worker's request is
cancelled), a client that reads nothing for ``[api] write_timeout`` (the generation call resets the
stream and cancels the generation, as for SSE), the metadata admission sees and the metrics route
(``GRPC_ROUTE``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .. import clock
from ..errors import APIError, internal_error
from ..http.common import spawn
from ..http.types import Call, Entrance, Request, RequestBodyStream, ResponseSink
from .call_core import CallAborted, call_metadata, request_message
from .compression import Codecs
from .convert import spec_from, text_metadata
from .grpc_web import WebEvent
from .native import NOT_METADATA, NativeCall, NativeRejection, NativeResponseWriter, is_grpc, open_call
from .native_frame_writer import GrpcFrameWriter
from .pipeline_backend import PipelineBackend
from .quicserve.v1 import quicserve_pb2 as pb
from .status import Status, grpc_status, parse_grpc_timeout

__all__ = ["GENERATE", "NativeEntrance"]

GENERATE = "/quicserve.v1.Inference/Generate"
_perf = clock.now  # the request clock (gateway/clock.py)


class _Generate:
    """One native ``Generate`` call (the adapter's :class:`Call`): its message, then its generation."""

    __slots__ = ("_entrance", "_request", "_sink", "_done", "_opened", "_timeout", "_t0", "_reader", "_call")

    def __init__(self, entrance: NativeEntrance, request: Request, sink: ResponseSink, done: Callable[[], None],
                 opened: NativeCall, timeout: float | None, t0: float) -> None:
        self._entrance = entrance
        self._request = request
        self._sink = sink
        self._done = done
        self._opened = opened
        self._timeout = timeout
        self._t0 = t0
        self._call: Call | None = None  # the generation, once started (it calls done() itself)
        self._reader: asyncio.Task[None] | None = None

    def begin(self, body: RequestBodyStream | None) -> None:
        if body is None:  # the body came whole (END_STREAM on the HEADERS: none)
            try:
                self._started(_one_message(self._opened, [self._request.body]))
            except CallAborted as f:
                self._answer(f.status, f.message)
                asyncio.get_running_loop().call_soon(self._done)
            return
        self._reader = spawn(asyncio.get_running_loop(), self._read(body))
        self._reader.add_done_callback(self._read_done)

    async def _read(self, body: RequestBodyStream) -> None:
        """Wait for the one message (each wait bounded by the stall timeout, all by grpc-timeout)."""
        try:
            async with asyncio.timeout(self._timeout):
                message = await _read_message(self._opened, body, self._entrance.stall_timeout)
        except CallAborted as f:
            return self._answer(f.status, f.message)
        except TimeoutError:
            return self._answer(Status.DEADLINE_EXCEEDED, "Deadline exceeded")
        except ConnectionError:
            return  # the client went away: nobody to tell
        try:
            self._started(message)
        except CallAborted as f:
            self._answer(f.status, f.message)

    def _read_done(self, task: asyncio.Task[None]) -> None:
        self._reader = None
        if not task.cancelled() and task.exception() is not None:
            err = internal_error()
            self._answer(grpc_status(err), err.message)
        if self._call is None:  # never handed to the pipeline: the call ends here
            self._done()

    def _started(self, message: pb.GenerateRequest) -> None:
        """Hand the request to the pipeline (which answers refusals and calls done() itself)."""
        deadline = None if self._timeout is None else self._t0 + self._timeout  # on the request clock
        try:
            spec = spec_from(message, deadline, text_metadata(call_metadata(dict(self._request.headers), NOT_METADATA)))
        except APIError as e:
            raise CallAborted(grpc_status(e), e.message) from None
        frames = GrpcFrameWriter(self._opened.writer)
        # a refusal (parse, admission, routing) is the writer's trailers-only error; the generation
        # call bounds every wait for the client by [api] write_timeout, as for SSE
        self._call = self._entrance.backend.start(spec, frames, lambda sink, err: sink.respond(*frames.error(err)),
                                                  self._sink, self._done, self._t0)

    def _answer(self, status: Status, message: str) -> None:
        _trailers_only(self._sink, self._opened.writer, status, message)

    def cancel(self) -> bool:
        """RST_STREAM or a lost connection: stop reading, or cancel the generation."""
        if self._call is not None:
            return bool(self._call.cancel())
        if self._reader is not None:
            return self._reader.cancel()
        return False


class NativeEntrance:
    """The gRPC port's entrance: native ``Generate`` on the pipeline directly (:class:`_Generate`),
    every other request through ``other`` (the service's route, a task per call)."""

    def __init__(self, backend: PipelineBackend, other: Entrance, codecs: Codecs, max_message: int,
                 stall_timeout: float | None = None) -> None:
        self.backend = backend
        self.stall_timeout = stall_timeout
        self._other = other
        self._codecs = codecs
        self._max_message = max_message

    def __call__(self, request: Request, sink: ResponseSink, done: Callable[[], None]) -> Call:
        if (request.path != GENERATE or request.method != "POST" or request.protocol != "h2"
                or not is_grpc(request.header(b"content-type", b"") or b"")):
            return self._other(request, sink, done)
        t0 = _perf()
        headers = dict(request.headers)
        opened = open_call(headers, self._codecs, self._max_message)
        if isinstance(opened, NativeRejection):  # an encoding we do not offer: UNIMPLEMENTED
            return _answered(sink, opened.writer, opened.status, opened.message, done)
        timeout: float | None = None
        if (raw := headers.get(b"grpc-timeout")) is not None:
            try:
                timeout = parse_grpc_timeout(raw)
            except APIError as e:  # a protocol error, as grpc-go answers it
                return _answered(sink, opened.writer, Status.INTERNAL, e.message, done)
        call = _Generate(self, request, sink, done, opened, timeout, t0)
        call.begin(request.stream)
        return call


class _Answered:
    __slots__ = ()

    def cancel(self) -> bool:
        return False


_ANSWERED = _Answered()


def _answered(sink: ResponseSink, writer: NativeResponseWriter, status: Status, message: str,
              done: Callable[[], None]) -> Call:
    """A call answered at its headers (trailers-only); ``done`` on the next loop iteration."""
    _trailers_only(sink, writer, status, message)
    asyncio.get_running_loop().call_soon(done)
    return _ANSWERED


def _trailers_only(sink: ResponseSink, writer: NativeResponseWriter, status: Status, message: str) -> None:
    """The status in the one HEADERS frame (END_STREAM on it), as gRPC's Trailers-Only response."""
    sink.respond(200, [*writer.headers(), *writer.trailers(status, message)], b"")


def _first(events: list[WebEvent]) -> pb.GenerateRequest | None:
    """The request message the first of ``events`` carries (None: no event yet); the end of the
    requests before it is an error."""
    if not events:
        return None
    message: pb.GenerateRequest | None = request_message(events[0], pb.GenerateRequest)
    if message is None:
        raise CallAborted(Status.INTERNAL, "no request message")  # RequestEnded
    return message


def _one_message(opened: NativeCall, chunks: list[bytes]) -> pb.GenerateRequest:
    """The one message of a body that came whole."""
    reader = opened.reader
    events: list[WebEvent] = []
    for chunk in chunks:
        if chunk:
            events.extend(reader.receive_data(chunk))
    events.extend(reader.end_of_stream())
    message = _first(events)
    if message is None:
        raise CallAborted(Status.INTERNAL, "no request message")
    return message


async def _read_message(opened: NativeCall, body: RequestBodyStream, stall: float | None) -> pb.GenerateRequest:
    """The one message of a body read as it arrives (a wait for more bounded by ``stall``: DEADLINE_EXCEEDED,
    as the service's unary calls are)."""
    reader = opened.reader
    while True:
        try:
            async with asyncio.timeout(stall):
                chunk = await body.read()
        except TimeoutError:
            raise CallAborted(Status.DEADLINE_EXCEEDED,
                          f"The request message stopped arriving ({stall:g} s without data).") from None
        except APIError as e:  # the adapter refused the rest of the body (413)
            raise CallAborted(grpc_status(e), e.message) from None
        events = reader.receive_data(chunk) if chunk else reader.end_of_stream()
        message = _first(events)
        if message is not None:
            return message
        if not chunk:
            raise CallAborted(Status.INTERNAL, "no request message")
