"""What a request is on HTTP, whichever version carries it: its path, its headers, and how its
response body is read (OpenAI JSON, OpenAI SSE, or gRPC-Web frames).

The HTTP senders (``http1``, ``http2``, ``http3``) take an :class:`Exchange` and know nothing of
what they carry: at the response's headers they ask :meth:`Exchange.reader` for a reader of its
body, feed it every piece with its arrival time, and tell it the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .bodies import ENDPOINTS
from .records import BodyReader, ErrorReader, Record, SSEReader, WholeReader

__all__ = ["Exchange", "openai_exchange", "grpc_web_exchange"]


@dataclass(frozen=True, slots=True)
class Exchange:
    path: str
    headers: tuple[tuple[str, str], ...]  # lower-case names; no host, content-length or pseudo-headers
    body_reader: Callable[[Record], BodyReader]

    def reader(self, rec: Record, status: int) -> BodyReader:
        """The reader of a response with this HTTP status."""
        return self.body_reader(rec) if status == 200 else ErrorReader(rec, status)

    def head(self, scheme: str, authority: str, base_path: str = "") -> list[tuple[bytes, bytes]]:
        """The request's header block for HTTP/2 and HTTP/3 (pseudo-headers first)."""
        return [(b":method", b"POST"), (b":scheme", scheme.encode()), (b":authority", authority.encode()),
                (b":path", (base_path.rstrip("/") + self.path).encode()),
                *((k.encode(), v.encode()) for k, v in self.headers)]


def _auth(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def openai_exchange(endpoint: str, *, stream: bool, api_key: str = "") -> Exchange:
    """``/v1/completions`` or ``/v1/chat/completions``: JSON in; SSE or one JSON document out."""
    headers = (("content-type", "application/json"),) + (
        (("accept", "text/event-stream"),) if stream else ()) + _auth(api_key)
    return Exchange(ENDPOINTS[endpoint], headers, SSEReader if stream else WholeReader)


def grpc_web_exchange(*, stream: bool, api_key: str = "") -> Exchange:
    """quicserve's ``Generate`` (streamed) or ``Complete`` as gRPC-Web, binary framing."""
    from .grpc_web import GrpcWebReader, method_path

    def reader(rec: Record) -> BodyReader:
        return GrpcWebReader(rec, stream=stream)

    headers = (("content-type", "application/grpc-web+proto"), ("accept", "application/grpc-web+proto"),
               ("x-grpc-web", "1")) + _auth(api_key)
    return Exchange(method_path(stream), headers, reader)
