"""Message compression: ``grpc-encoding`` / ``grpc-accept-encoding`` negotiation.

The server offers zstd, gzip and identity (in that order of preference). A
request's ``grpc-encoding`` names the codec of its compressed messages (flag
0x01); an encoding we do not offer is UNIMPLEMENTED, answered with the list we
accept. Responses are compressed with the best codec the client lists in
``grpc-accept-encoding`` (none listed: identity). :func:`encode_message`
sends a message uncompressed (flag 0) whenever compressing would not make it
smaller, so compression never costs bytes on the wire; messages too short to
hold a codec's fixed framing are not even tried.

Decompression is bounded: a message that inflates past the limit is
:class:`MessageTooLarge` (RESOURCE_EXHAUSTED), whatever its frame header or
compressed size claimed, so a small "zip bomb" cannot take the gateway's memory.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import zstandard

from .framing import FLAG_COMPRESSED, encode_frame

__all__ = [
    "Codec",
    "GzipCodec",
    "ZstdCodec",
    "CorruptMessage",
    "MessageTooLarge",
    "Codecs",
    "Negotiation",
    "UnsupportedEncoding",
    "encode_message",
]


class CorruptMessage(Exception):
    """Compressed bytes that do not decompress (INTERNAL in gRPC's terms)."""


class MessageTooLarge(Exception):
    """A message that decompresses past the size limit (RESOURCE_EXHAUSTED)."""


class Codec(Protocol):
    name: str
    #: Bytes every compressed output has at least: shorter inputs cannot shrink.
    overhead: int
    #: Messages up to this size go uncompressed without trying (at least ``overhead``).
    min_size: int

    def compress(self, data: bytes) -> bytes: ...

    def decompress(self, data: bytes, limit: int) -> bytes:
        """``data`` inflated; :class:`MessageTooLarge` past ``limit`` bytes, :class:`CorruptMessage`."""
        ...


class GzipCodec:
    name = "gzip"
    overhead = 18  # 10-byte gzip header + CRC32 and size trailer

    def __init__(self, level: int = 6, min_size: int = 0) -> None:
        self.level = level
        self.min_size = max(self.overhead, min_size)

    def compress(self, data: bytes) -> bytes:
        return zlib.compress(data, self.level, wbits=31)

    def decompress(self, data: bytes, limit: int) -> bytes:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out = inflater.decompress(data, limit + 1)
        except zlib.error as e:
            raise CorruptMessage(f"gzip: {e}") from None
        if len(out) > limit:
            raise MessageTooLarge(f"message inflates past the limit of {limit} bytes")
        if not inflater.eof or inflater.unused_data:
            raise CorruptMessage("gzip: truncated stream or trailing bytes")
        return out


class ZstdCodec:
    name = "zstd"
    overhead = 8  # 4-byte magic, frame header descriptor, 3-byte block header

    def __init__(self, level: int = 3, min_size: int = 0) -> None:
        self.level = level
        self.min_size = max(self.overhead, min_size)
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._decompressor = zstandard.ZstdDecompressor()

    def compress(self, data: bytes) -> bytes:
        return self._compressor.compress(data)

    def decompress(self, data: bytes, limit: int) -> bytes:
        # python-zstandard has no bounded one-shot call that also reports truncation, so the
        # input goes in small steps: one step inflates to at most _ZSTD_STEP * 32 KiB (a 4-byte
        # RLE block is 128 KiB), which bounds memory whatever the frame header claims.
        inflater = self._decompressor.decompressobj()
        out = bytearray()
        try:
            for pos in range(0, len(data), _ZSTD_STEP):
                if inflater.eof:
                    raise CorruptMessage("zstd: trailing bytes after the frame")
                out += inflater.decompress(data[pos:pos + _ZSTD_STEP])
                if len(out) > limit:
                    raise MessageTooLarge(f"message inflates past the limit of {limit} bytes")
        except zstandard.ZstdError as e:
            raise CorruptMessage(f"zstd: {e}") from None
        if not inflater.eof or inflater.unused_data:
            raise CorruptMessage("zstd: truncated frame or trailing bytes")
        return bytes(out)


_ZSTD_STEP = 128


def encode_message(payload: bytes, codec: Codec | None) -> bytes:
    """One message frame, compressed (flag 0x01) only when that makes it smaller. Messages up to
    the codec's ``min_size`` are not tried: a streamed token's delta is a few bytes, which no codec
    shrinks, and trying costs more CPU per stream than the rest of the message's path."""
    if codec is not None and len(payload) > codec.min_size:
        packed = codec.compress(payload)
        if len(packed) < len(payload):
            return encode_frame(FLAG_COMPRESSED, packed)
    return encode_frame(0, payload)


@dataclass(frozen=True, slots=True)
class Negotiation:
    request: Codec | None  # decodes request messages flagged compressed; None: identity
    response: Codec | None  # compresses response messages; None: identity


@dataclass(frozen=True, slots=True)
class UnsupportedEncoding:
    """The request's ``grpc-encoding`` is not one we offer: answer UNIMPLEMENTED with ``accept``."""

    encoding: str
    accept: str

    @property
    def message(self) -> str:
        return f"grpc-encoding {self.encoding!r} is not supported; accepted: {self.accept}"


class Codecs:
    """The codecs this server offers, built once from its settings (levels)."""

    def __init__(self, zstd_level: int = 3, gzip_level: int = 6, min_size: int = 64) -> None:
        self._by_name: dict[str, Codec] = {"zstd": ZstdCodec(zstd_level, min_size),
                                           "gzip": GzipCodec(gzip_level, min_size)}
        #: The ``grpc-accept-encoding`` value we send, in order of preference.
        self.accept_encoding = ",".join([*self._by_name, "identity"])

    def negotiate(self, encoding: str | None, accept: str | None) -> Negotiation | UnsupportedEncoding:
        """Codecs for one call from its ``grpc-encoding`` and ``grpc-accept-encoding`` headers."""
        request: Codec | None = None
        name = (encoding or "identity").strip().lower()
        if name != "identity":
            found = self._by_name.get(name)
            if found is None:
                return UnsupportedEncoding(name, self.accept_encoding)
            request = found
        accepted = {a.strip().lower() for a in accept.split(",")} if accept else set()
        response = next((c for n, c in self._by_name.items() if n in accepted), None)
        return Negotiation(request, response)
