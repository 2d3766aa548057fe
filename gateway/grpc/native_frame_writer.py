"""The native gRPC ``Generate`` writer: the pipeline's writer for framed protobuf, as SSE's is for events.

How it works: :class:`GrpcFrameWriter` has the :class:`~gateway.api.writers.Writer` shape, so the
generation call (:class:`~gateway.api.call.GenerationCall`) writes a native ``Generate`` stream from
its token callback straight to the HTTP/2 sink, with no task and no handler between them. Each
engine step's text is one ``GenerateResponse`` message (built by hand: field 1, the text), framed
and compressed (:func:`~gateway.grpc.compression.encode_message`: a delta too short to shrink goes
uncompressed, flag 0) with the call's negotiated codec. The finish is the last message
(``finish_reason``, ``usage``) and sets :attr:`~GrpcFrameWriter.trailers` to ``grpc-status: 0``,
which the call ends the sink with (``sink.end(writer.trailers)``); an error once the stream has
started sets the mapped status (:func:`~gateway.grpc.status.grpc_status`) instead, and one before
it is a trailers-only response (the status in the one HEADERS frame, END_STREAM on it).
"""

from __future__ import annotations

from transport.messages import Finish, FinishReason, TokenEntry

from ..errors import APIError, Headers
from .backend import CANCELLED, Finished
from .compression import encode_message
from .convert import reason_of, usage_of
from .native import NativeResponseWriter
from .quicserve.v1 import quicserve_pb2 as pb
from .status import Status, grpc_status, retry_trailers

__all__ = ["GrpcFrameWriter", "text_message", "status_trailers"]


def text_message(delta: bytes) -> bytes:
    """``GenerateResponse(text=delta)`` serialized (what protobuf writes: tag 0x0a, length, UTF-8)."""
    if not delta.isascii():
        delta = bytes(delta).decode("utf-8", "replace").encode()
    n = len(delta)
    if n < 0x80:
        return b"\x0a" + bytes((n,)) + delta
    size = bytearray()
    while n >= 0x80:
        size.append(n & 0x7F | 0x80)
        n >>= 7
    size.append(n)
    return b"\x0a" + bytes(size) + delta


def status_trailers(writer: NativeResponseWriter, err: APIError) -> Headers:
    """The trailers of a call that ends with ``err`` (the same status and trailers as the service's)."""
    return writer.trailers(grpc_status(err), err.message, retry_trailers(err))


class GrpcFrameWriter:
    """One native ``Generate`` call's writer (see the module docstring)."""

    __slots__ = ("_w", "_codec", "headers", "trailers")
    streaming = True

    def __init__(self, writer: NativeResponseWriter) -> None:
        self._w = writer
        self._codec = writer.codec
        self.headers: Headers = writer.headers()
        self.trailers: Headers | None = None  # set by the end: what the call ends the sink with

    def opening(self) -> bytes:
        return b""

    def text(self, delta: bytes) -> bytes:
        if not delta:
            return b""  # an engine step that decoded to no text: no empty message
        return encode_message(text_message(delta), self._codec)

    def entries(self, events: list[TokenEntry]) -> bytes:
        return self.text(b"".join(bytes(ev.text) for ev in events))

    def finish(self, fin: Finish) -> bytes:
        if fin.reason == FinishReason.CANCELLED:  # cancelled without the client asking: an error to it
            self.trailers = status_trailers(self._w, CANCELLED)
            return b""
        done = Finished(FinishReason(fin.reason), fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
        last = pb.GenerateResponse(finish_reason=reason_of(done), usage=usage_of(done)).SerializeToString()
        self.trailers = self._w.trailers(Status.OK)
        return encode_message(last, self._codec)

    def error(self, err: APIError) -> tuple[int, Headers, bytes]:
        """Trailers-only: HTTP 200, the call's headers and its status in one HEADERS frame."""
        return 200, [*self.headers, *status_trailers(self._w, err)], b""

    def stream_error(self, err: APIError) -> bytes:
        self.trailers = status_trailers(self._w, err)
        return b""
