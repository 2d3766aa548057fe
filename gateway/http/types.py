"""The one internal request / response-stream type every protocol adapter produces.

Adapters (h1 over httptools, h2 over h2, later h3 over aioquic) parse their
protocol, enforce limits (header size -> 431, body size -> 413, read timeouts
-> 408) and call the application handler with a :class:`Request` whose body has
been read in full, plus a :class:`ResponseSink`. Handlers never see which
protocol carried them (``request.protocol`` is informational, for metrics).

When the client disconnects, the adapter cancels the handler's task
(``asyncio.CancelledError`` inside the handler), so ``finally:`` blocks run and
the handler cancels its worker request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Request", "RequestBodyStream", "ResponseSink", "Handler", "Headers", "Call", "FastHandler"]

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class Request:
    method: str  # "GET", "POST", ...
    path: str  # percent-decoded path without query, e.g. "/v1/models"
    query: str  # raw query string without '?'
    headers: Headers  # names lower-cased bytes, in order
    body: bytes
    protocol: str  # "http/1.1" | "h2" | "h3"
    scheme: str  # "http" | "https"
    client: tuple[str, int] | None = None
    # Room for protocols whose request body is itself a stream (gRPC client
    # streaming): an adapter that serves such a route sets ``stream`` and leaves
    # ``body`` empty. HTTP/1.1 and HTTP/2 adapters today always read the body in
    # full (bounded by the body limit) and leave this None.
    stream: RequestBodyStream | None = None

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """First value of a header (``name`` lower-case)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default


class RequestBodyStream(Protocol):
    """Incremental request body (see :attr:`Request.stream`)."""

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` once it has ended."""
        ...


class ResponseSink(Protocol):
    """Where a handler writes its response. Exactly one of ``respond`` or
    ``start`` + ``send``* + ``end`` per request."""

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """Complete response in one go (sets content-length)."""
        ...

    async def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed response (chunked in h1, DATA frames in h2)."""
        ...

    async def send(self, data: bytes) -> None:
        """Write a chunk; waits while the peer's flow-control window / socket
        buffer is full (backpressure)."""
        ...

    async def end(self) -> None: ...


Handler = Callable[[Request, ResponseSink], Awaitable[None]]


class Call(Protocol):
    """A request the application runs by callbacks rather than in a task (see :data:`FastHandler`)."""

    def cancel(self) -> object:
        """The client went away: stop (cancel the worker request); ``done`` still comes, once."""
        ...


FastHandler = Callable[[Request, ResponseSink, Callable[[], None]], "Call | None"]
"""Optional fast path an application may offer as ``handler.fast(request, sink, done)``.

It returns None (the adapter runs ``handler`` in a task, as always) or a :class:`Call`
that has taken the request: it answers through ``sink.respond_nowait(status, headers,
body)`` and then calls ``done()`` exactly once, never from inside ``fast`` itself. The
adapter calls ``call.cancel()`` if the client goes away first. Adapters whose sinks have
no ``respond_nowait`` never get a Call.
"""
