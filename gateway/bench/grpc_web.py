"""gRPC-Web, binary framing, over any of the bench's HTTP senders: quicserve's ``Generate``
(streamed: a message per engine step, the last with usage) and ``Complete`` (one message).

A request body is one length-prefixed ``GenerateRequest`` frame (rendered once before the
run). The response body is message frames, then the trailer frame (flag 0x80) with
``grpc-status``; a browser cannot read HTTP trailers, so the status travels in the body, and a
body that ends without it is an incomplete stream. Each message with text is a token time, as
an SSE chunk with text is.
"""

from __future__ import annotations

from grpclib.const import Status
from grpclib.metadata import decode_grpc_message

from gateway.grpc.framing import FLAG_TRAILERS, FrameDecoder, FrameTooLarge, encode_frame

from .records import Record

__all__ = ["GrpcWebReader", "method_path", "frame_body"]

_SERVICE = "/quicserve.v1.Inference/"
_MAX_MESSAGE = 64 << 20
_CODES = frozenset(s.value for s in Status)


def method_path(stream: bool) -> str:
    return _SERVICE + ("Generate" if stream else "Complete")


def frame_body(message: bytes) -> bytes:
    """A serialized request message as a gRPC-Web request body (one uncompressed frame)."""
    return encode_frame(0, message)


def _trailers(block: bytes) -> dict[str, str]:
    out = {}
    for line in block.decode("latin-1").split("\r\n"):
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


class GrpcWebReader:
    """A gRPC-Web response body, split anywhere, into its record."""

    __slots__ = ("rec", "stream", "frames", "chunks", "status", "has_usage", "_parse")

    def __init__(self, rec: Record, *, stream: bool) -> None:
        from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

        self.rec, self.stream = rec, stream
        self.frames = FrameDecoder(_MAX_MESSAGE)
        self.chunks = 0
        self.status: int | None = None
        self.has_usage = False
        self._parse = pb.GenerateResponse.FromString

    def feed(self, data: bytes, t: float) -> None:
        try:
            frames = self.frames.feed(data)
        except FrameTooLarge as e:
            self.rec.fail("bad_stream", str(e))
            return
        for f in frames:
            if f.flags & FLAG_TRAILERS:
                self._status(f.flags, f.payload)
            elif f.flags:
                self.rec.fail("bad_stream", f"a compressed message (flags 0x{f.flags:02x}) that was not asked for")
            else:
                self._message(f.payload, t)

    def _message(self, payload: bytes, t: float) -> None:
        msg = self._parse(payload)
        if msg.text:
            self.chunks += 1
            if self.stream:
                self.rec.token_at(t)
        if msg.HasField("usage"):
            self.has_usage = True
            self.rec.output_tokens = msg.usage.completion_tokens
            self.rec.prompt_tokens = msg.usage.prompt_tokens or self.rec.prompt_tokens

    def _status(self, flags: int, block: bytes) -> None:
        if flags != FLAG_TRAILERS:
            self.rec.fail("bad_stream", f"a compressed trailer frame (flags 0x{flags:02x})")
            return
        fields = _trailers(block)
        try:
            self.status = int(fields.get("grpc-status", ""))
        except ValueError:
            self.rec.fail("bad_stream", f"a trailer frame without grpc-status: {block[:100]!r}")
            return
        if self.status:
            name = Status(self.status).name if self.status in _CODES else str(self.status)
            kind = "timeout" if self.status == Status.DEADLINE_EXCEEDED.value else f"grpc_{name}"
            self.rec.fail(kind, decode_grpc_message(fields.get("grpc-message", "")))

    def finish(self, t: float) -> None:
        rec = self.rec
        rec.end = t
        if not self.stream and not rec.error:
            rec.ttft = t - rec.start
        if self.status is None:
            rec.fail("incomplete_stream", "the body ended without a trailer frame (grpc-status)")
        elif not self.has_usage:
            rec.output_tokens = self.chunks
