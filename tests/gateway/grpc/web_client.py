"""The client side of gRPC-Web for tests, written independently of gateway.grpc.web."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

from gateway.grpc.compression import GzipCodec, ZstdCodec

__all__ = ["CODECS", "Parsed", "frame", "parse_body", "decode_text"]

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
