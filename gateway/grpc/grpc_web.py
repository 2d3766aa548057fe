"""gRPC-Web request and response bodies (sans-I/O).

How it works: an HTTP adapter that sees a gRPC-Web content type calls
:func:`open_call` with the request headers. It gets a :class:`WebCall` (or a
:class:`Rejection` to answer at once), whose ``reader`` turns request body
bytes, split anywhere, into :class:`MessageReceived` events, then
:class:`RequestEnded` -- or one :class:`CallFailed` carrying the gRPC status
to answer with, after which the reader ignores further bytes. Nothing here
raises into the adapter. The ``writer`` turns response messages and the final
status into body bytes: length-prefixed message frames and the trailer frame
(flag 0x80, HTTP/1-style ``grpc-status`` / ``grpc-message`` lines), since a
browser cannot read HTTP trailers.

``application/grpc-web-text`` carries the same frames in base64. Requests are
decoded incrementally: a chunk may end inside a 4-character quantum, and
clients may send several padded segments back to back, so each quantum is
decoded on its own terms. Each response write is its own padded segment, so a
token reaches the browser without waiting for the next one.

With zstd negotiated the trailer frame is compressed too (flags 0x81) --
when that makes it smaller, like every other message.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .compression import Codec, Codecs, CorruptMessage, MessageTooLarge, UnsupportedEncoding, encode_message
from .framing import FLAG_COMPRESSED, FLAG_TRAILERS, FrameDecoder, FrameTooLarge, encode_frame
from .status import Status, encode_grpc_message

__all__ = [
    "MessageReceived",
    "RequestEnded",
    "CallFailed",
    "WebEvent",
    "WebRequestReader",
    "WebResponseWriter",
    "WebCall",
    "Rejection",
    "is_grpc_web",
    "open_call",
]

_BINARY = (b"application/grpc-web", b"application/grpc-web+proto")
_TEXT = (b"application/grpc-web-text", b"application/grpc-web-text+proto")


@dataclass(frozen=True, slots=True)
class MessageReceived:
    data: bytes  # one serialized protobuf message, decompressed


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """The request body ended cleanly after its last message."""


@dataclass(frozen=True, slots=True)
class CallFailed:
    """The request body is unusable: answer with this status (in the trailer frame)."""

    status: Status
    message: str


WebEvent = MessageReceived | RequestEnded | CallFailed


class _Failure(Exception):
    """Internal: unwinds the reader to the one place that turns it into :class:`CallFailed`."""

    def __init__(self, status: Status, message: str) -> None:
        self.status = status
        self.message = message


class _Base64Segments:
    """Base64 text to bytes, fed in pieces that may split quanta or hold padded segments."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> bytes:
        data = self._rest + data
        whole = len(data) - len(data) % 4
        self._rest = data[whole:]
        return _decode_quanta(data[:whole])

    def end(self) -> bytes:
        """What is left; an unpadded final segment of 2 or 3 characters is accepted."""
        rest, self._rest = self._rest, b""
        if len(rest) == 1:
            raise _Failure(Status.INVALID_ARGUMENT, "grpc-web-text body ends inside a base64 quantum")
        return _decode_quanta(rest + b"=" * (-len(rest) % 4)) if rest else b""


def _decode_quanta(text: bytes) -> bytes:
    # Padding ends a segment but not the body: decode up to the end of each padded quantum.
    out = []
    pos = 0
    try:
        while (pad := text.find(b"=", pos)) >= 0:
            stop = pad - pad % 4 + 4
            out.append(binascii.a2b_base64(text[pos:stop], strict_mode=True))
            pos = stop
        if pos < len(text):
            out.append(binascii.a2b_base64(text[pos:], strict_mode=True))
    except binascii.Error as e:
        raise _Failure(Status.INVALID_ARGUMENT, f"grpc-web-text body is not base64: {e}") from None
    return b"".join(out)


class WebRequestReader:
    """Request body bytes -> :data:`WebEvent` s (see the module docstring)."""

    def __init__(self, *, text: bool, codec: Codec | None, max_message: int) -> None:
        self._text = _Base64Segments() if text else None
        self._codec = codec
        self._max = max_message
        self._frames = FrameDecoder(max_message)
        self._done = False

    @property
    def pending(self) -> bool:
        """Part of a message is held: the body has stopped inside a frame (so far)."""
        return self._frames.pending > 0

    def receive_data(self, data: bytes) -> list[WebEvent]:
        if self._done:
            return []
        try:
            if self._text is not None:
                data = self._text.feed(data)
            return self._messages(data)
        except _Failure as f:
            return [self._fail(f.status, f.message)]

    def end_of_stream(self) -> list[WebEvent]:
        if self._done:
            return []
        try:
            events = self._messages(self._text.end()) if self._text is not None else []
        except _Failure as f:
            return [self._fail(f.status, f.message)]
        if self._done:
            return events
        if self._frames.pending:
            return [*events, self._fail(Status.INTERNAL,
                                        f"request body ends inside a frame ({self._frames.pending} bytes)")]
        self._done = True
        return [*events, RequestEnded()]

    def _messages(self, data: bytes) -> list[WebEvent]:
        try:
            frames = self._frames.feed(data)
        except FrameTooLarge as e:
            raise _Failure(Status.RESOURCE_EXHAUSTED, str(e)) from None
        events: list[WebEvent] = []
        for frame in frames:
            if frame.flags & ~FLAG_COMPRESSED:
                raise _Failure(Status.INTERNAL, f"unexpected frame flags 0x{frame.flags:02x} in a request")
            payload = frame.payload
            if frame.flags & FLAG_COMPRESSED:
                if self._codec is None:
                    raise _Failure(Status.INTERNAL, "compressed message without a grpc-encoding")
                try:
                    payload = self._codec.decompress(payload, self._max)
                except MessageTooLarge as e:
                    raise _Failure(Status.RESOURCE_EXHAUSTED, str(e)) from None
                except CorruptMessage as e:
                    raise _Failure(Status.INTERNAL, str(e)) from None
            events.append(MessageReceived(payload))
        return events

    def _fail(self, status: Status, message: str) -> CallFailed:
        self._done = True
        return CallFailed(status, message)


class WebResponseWriter:
    """Response messages and the final status -> gRPC-Web body bytes."""

    def __init__(self, *, text: bool, codec: Codec | None, accept_encoding: str) -> None:
        self.text = text
        self.codec = codec
        self.accept_encoding = accept_encoding  # what we accept, sent on every response

    def headers(self) -> list[tuple[bytes, bytes]]:
        """HTTP response headers (the status itself travels in the trailer frame)."""
        ctype = _TEXT[1] if self.text else _BINARY[1]
        headers = [(b"content-type", ctype), (b"grpc-accept-encoding", self.accept_encoding.encode())]
        if self.codec is not None:
            headers.append((b"grpc-encoding", self.codec.name.encode()))
        return headers

    def message(self, payload: bytes) -> bytes:
        return self._out(encode_message(payload, self.codec))

    def trailers(self, status: Status, message: str = "",
                 metadata: Iterable[tuple[str, str]] = ()) -> bytes:
        """The trailer frame: ``grpc-status``, ``grpc-message`` (percent-encoded), ``metadata``."""
        lines = [f"grpc-status:{status.value}\r\n"]
        if message:
            lines.append(f"grpc-message:{encode_grpc_message(message)}\r\n")
        lines.extend(f"{k.lower()}:{v}\r\n" for k, v in metadata)
        block = "".join(lines).encode("ascii")
        frame = encode_frame(FLAG_TRAILERS, block)
        if self.codec is not None and self.codec.name == "zstd":
            packed = encode_message(block, self.codec)
            if packed[0] & FLAG_COMPRESSED:
                frame = bytes([FLAG_TRAILERS | FLAG_COMPRESSED]) + packed[1:]
        return self._out(frame)

    def _out(self, frame: bytes) -> bytes:
        return base64.b64encode(frame) if self.text else frame


@dataclass(frozen=True, slots=True)
class WebCall:
    reader: WebRequestReader
    writer: WebResponseWriter


@dataclass(frozen=True, slots=True)
class Rejection:
    """Answer at once: HTTP 200, ``writer.headers`` and ``writer.trailers(status, message)``."""

    writer: WebResponseWriter
    status: Status
    message: str


def _media_type(content_type: bytes) -> bytes:
    return content_type.split(b";", 1)[0].strip().lower()


def is_grpc_web(content_type: bytes) -> bool:
    """True for the content types this module serves (binary or text, ``+proto`` or bare)."""
    media = _media_type(content_type)
    return media in _BINARY or media in _TEXT


def open_call(headers: Mapping[bytes, bytes], codecs: Codecs, max_message: int) -> WebCall | Rejection:
    """Start a gRPC-Web call from its request headers (lower-case names)."""
    text = _media_type(headers.get(b"content-type", b"")) in _TEXT
    encoding = headers.get(b"grpc-encoding")
    accept = headers.get(b"grpc-accept-encoding")
    nego = codecs.negotiate(encoding.decode("latin-1") if encoding is not None else None,
                            accept.decode("latin-1") if accept is not None else None)
    if isinstance(nego, UnsupportedEncoding):
        writer = WebResponseWriter(text=text, codec=None, accept_encoding=codecs.accept_encoding)
        return Rejection(writer, Status.UNIMPLEMENTED, nego.message)
    return WebCall(WebRequestReader(text=text, codec=nego.request, max_message=max_message),
                   WebResponseWriter(text=text, codec=nego.response, accept_encoding=codecs.accept_encoding))
