"""The client side of gRPC-Web for tests, written independently of gateway.grpc.grpc_web."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

from gateway.grpc.compression import GzipCodec, ZstdCodec
from gateway.grpc.quicserve.v1 import quicserve_pb2 as pb

__all__ = ["CODECS", "Parsed", "frame", "parse_body", "decode_text", "chat_turn", "chat_replies"]

CODECS = {"gzip": GzipCodec(), "zstd": ZstdCodec()}


@dataclass
class Parsed:
    messages: list[bytes]
    trailers: dict[str, str]
    trailer_flags: int


def frame(payload: bytes, flags: int = 0) -> bytes:
    return bytes([flags]) + struct.pack(">I", len(payload)) + payload


def decode_text(body: bytes) -> bytes:
    """A grpc-web-text response: padded base64 segments back to back, decoded quantum by quantum."""
    assert len(body) % 4 == 0
    return b"".join(base64.b64decode(body[i:i + 4], validate=True) for i in range(0, len(body), 4))


def parse_body(raw: bytes, encoding: str | None) -> Parsed:
    """Message frames then exactly one trailer frame, last; compressed frames inflated."""
    codec = CODECS.get(encoding or "")
    messages: list[bytes] = []
    trailers: dict[str, str] = {}
    tflags, pos = -1, 0
    while pos < len(raw):
        flags, n = struct.unpack(">BI", raw[pos:pos + 5])
        payload = raw[pos + 5:pos + 5 + n]
        pos += 5 + n
        if flags & 1:
            assert codec is not None, "compressed frame without a grpc-encoding"
            payload = codec.decompress(payload, 1 << 20)
        if flags & 0x80:
            assert pos == len(raw), "bytes after the trailer frame"
            tflags = flags
            trailers = dict(line.split(":", 1) for line in payload.decode().split("\r\n") if line)
        else:
            messages.append(payload)
    assert tflags >= 0, "no trailer frame"
    return Parsed(messages, trailers, tflags)


def chat_turn(text: str, max_tokens: int, model: str = "") -> bytes:
    """One framed ChatRequest carrying a user turn."""
    t = pb.Turn(model=model, messages=[pb.Message(role="user", content=text)],
                sampling=pb.Sampling(max_tokens=max_tokens))
    return frame(pb.ChatRequest(turn=t).SerializeToString())


def chat_replies(body: bytes) -> list[pb.ChatResponse]:
    """The ChatResponse messages of a (possibly partial) body, trailer frame skipped."""
    out, pos = [], 0
    while len(body) - pos >= 5 and len(body) - pos >= 5 + (n := int.from_bytes(body[pos + 1:pos + 5], "big")):
        if not body[pos] & 0x80:
            out.append(pb.ChatResponse.FromString(body[pos + 5:pos + 5 + n]))
        pos += 5 + n
    return out
