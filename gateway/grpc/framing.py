"""gRPC length-prefixed message framing (sans-I/O), as in native gRPC and gRPC-Web.

A frame is one flags byte, a 4-byte big-endian length and that many bytes.
Flag 0x01 marks a compressed message; gRPC-Web adds 0x80 for the trailer
frame that carries the response's status in the body. :class:`FrameDecoder`
takes bytes split anywhere and returns whole frames; it keeps one buffer and
cuts frames out of it with offsets, so a body that arrives in many small
pieces costs no copies beyond the frames themselves.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "FLAG_COMPRESSED",
    "FLAG_TRAILERS",
    "HEADER_SIZE",
    "Frame",
    "FrameTooLarge",
    "FrameDecoder",
    "encode_frame",
]

FLAG_COMPRESSED = 0x01
FLAG_TRAILERS = 0x80
_HEADER = struct.Struct(">BI")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True, slots=True)
class Frame:
    flags: int
    payload: bytes


class FrameTooLarge(Exception):
    """A frame header announced more bytes than the decoder accepts."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"message of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


def encode_frame(flags: int, payload: bytes) -> bytes:
    return _HEADER.pack(flags, len(payload)) + payload


class FrameDecoder:
    """Whole frames out of a byte stream split anywhere; lengths above ``max_length`` raise."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes held for a frame not yet complete (non-zero at the end means truncation)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos, end = 0, len(buf)
        while end - pos >= HEADER_SIZE:
            flags, length = _HEADER.unpack_from(buf, pos)
            if length > self.max_length:
                del buf[:pos]
                raise FrameTooLarge(length, self.max_length)
            stop = pos + HEADER_SIZE + length
            if stop > end:
                break
            frames.append(Frame(flags, bytes(buf[pos + HEADER_SIZE:stop])))
            pos = stop
        del buf[:pos]
        return frames
