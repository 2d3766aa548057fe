"""Native gRPC over HTTP/2 (sans-I/O): opening a call, its response headers and trailers.

How it works: native gRPC shares gRPC-Web's pieces -- length-prefixed frames
(:mod:`.framing`), ``grpc-encoding`` negotiation (:mod:`.compression`: zstd,
gzip, identity; a message that would not shrink goes uncompressed, flag 0) and
the request reader of :mod:`.grpc_web` in its binary mode, which turns body bytes
split anywhere into messages. What differs is the response: ``content-type:
application/grpc``, and the status in HTTP/2 trailing HEADERS (``grpc-status``,
``grpc-message`` percent-encoded, trailing metadata) instead of a trailer frame
in the body. :func:`open_call` takes the request headers and returns a
:class:`NativeCall`, or a :class:`NativeRejection` to answer at once (an
encoding we do not offer: UNIMPLEMENTED, with the ``grpc-accept-encoding`` we
do). :func:`is_grpc` tells a native gRPC request from anything else (HTTP 415
for those, as the gRPC over HTTP/2 spec says).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .compression import Codec, Codecs, UnsupportedEncoding, encode_message
from .grpc_web import WebRequestReader
from .status import Status, encode_grpc_message

__all__ = ["CONTENT_TYPE", "NOT_METADATA", "NativeCall", "NativeRejection", "NativeResponseWriter", "is_grpc", "open_call"]

# request headers of a native call that are not its metadata (beside the pseudo and grpc-* ones), as
# grpclib leaves them out; host is the adapter's copy of :authority
NOT_METADATA = frozenset((b"te", b"content-type", b"user-agent", b"host"))

CONTENT_TYPE = b"application/grpc"
_ACCEPTED = (b"application/grpc", b"application/grpc+proto")

Headers = list[tuple[bytes, bytes]]


def is_grpc(content_type: bytes) -> bool:
    """``application/grpc`` or ``application/grpc+proto`` (parameters and case aside)."""
    return content_type.split(b";", 1)[0].strip().lower() in _ACCEPTED


class NativeResponseWriter:
    """Response headers, message frames and the trailers of one native call."""

    def __init__(self, codec: Codec | None, accept_encoding: str) -> None:
        self.codec = codec
        self.accept_encoding = accept_encoding  # what we accept, sent on every response

    def headers(self) -> Headers:
        headers = [(b"content-type", CONTENT_TYPE), (b"grpc-accept-encoding", self.accept_encoding.encode())]
        if self.codec is not None:
            headers.append((b"grpc-encoding", self.codec.name.encode()))
        return headers

    def message(self, payload: bytes) -> bytes:
        return encode_message(payload, self.codec)

    def trailers(self, status: Status, message: str = "", metadata: Iterable[tuple[str, str]] = ()) -> Headers:
        """``grpc-status``, ``grpc-message`` (percent-encoded, if any), then ``metadata``."""
        out = [(b"grpc-status", b"%d" % status.value)]
        if message:
            out.append((b"grpc-message", encode_grpc_message(message).encode("ascii")))
        out.extend((k.lower().encode("ascii"), v.encode("latin-1")) for k, v in metadata)
        return out


@dataclass(frozen=True, slots=True)
class NativeCall:
    reader: WebRequestReader
    writer: NativeResponseWriter


@dataclass(frozen=True, slots=True)
class NativeRejection:
    """Answer at once: ``writer.headers()``, no message, ``writer.trailers(status, message)``."""

    writer: NativeResponseWriter
    status: Status
    message: str


def open_call(headers: Mapping[bytes, bytes], codecs: Codecs, max_message: int) -> NativeCall | NativeRejection:
    """Start a native call from its request headers (lower-case names)."""
    encoding = headers.get(b"grpc-encoding")
    accept = headers.get(b"grpc-accept-encoding")
    nego = codecs.negotiate(encoding.decode("latin-1") if encoding is not None else None,
                            accept.decode("latin-1") if accept is not None else None)
    if isinstance(nego, UnsupportedEncoding):
        return NativeRejection(NativeResponseWriter(None, codecs.accept_encoding), Status.UNIMPLEMENTED,
                               nego.message)
    return NativeCall(WebRequestReader(text=False, codec=nego.request, max_message=max_message),
                      NativeResponseWriter(nego.response, codecs.accept_encoding))
