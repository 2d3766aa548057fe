"""The wire's frame layer: header, frame types, limits (the spec is :mod:`transport.wire`'s).

Shared by the encoder (:mod:`transport.wire`) and the decoder (:mod:`transport.wire_decode`).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from .messages import PROTOCOL_VERSION

__all__ = [
    "WIRE_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "DEFAULT_MAX_FRAME",
    "HANDSHAKE_MAX_FRAME",
    "CHALLENGE_SIZE",
    "U32",
    "U64",
    "U64_MAX",
    "FrameType",
    "SubmitRejected",
    "version_problem",
]

WIRE_VERSION = PROTOCOL_VERSION
HEADER = struct.Struct("<BBHII")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 1 << 24
HANDSHAKE_MAX_FRAME = 1 << 16  # frames from a peer whose HELLO is not yet accepted (see the spec)
CHALLENGE_SIZE = 32  # bytes of a HELLO challenge and of an AUTH proof (HMAC-SHA256)
_TLS_RECORD = 0x16  # a TLS handshake record's first byte, where our version byte would be
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
U64_MAX = (1 << 64) - 1


class FrameType(enum.IntEnum):
    HELLO = 1
    SUBMIT = 2
    CANCEL = 3
    CREDIT = 4
    TOKENS = 5
    FINISH = 6
    ERROR = 7
    STATS = 8
    PING = 9
    PONG = 10
    GOODBYE = 11
    AUTH = 12
    KV_EVENTS = 13
    KV_SUBSCRIBE = 14


@dataclass(frozen=True, slots=True)
class SubmitRejected:
    """Decoded in place of a well-framed SUBMIT whose body is bad; its stream is open until the
    receiver's ERROR for it (see the spec above)."""

    request_id: int
    reason: str



def version_problem(version: int) -> str:
    """Why a frame header's version byte is refused (a TLS record gets its own hint)."""
    if version == _TLS_RECORD:  # a TLS ClientHello (or alert) where a frame should be
        return ("the peer speaks TLS and this side does not: configure transport_tls_cert, transport_tls_key "
                "and transport_tls_ca here too")
    return f"unsupported wire version {version} (this side speaks {WIRE_VERSION})"

