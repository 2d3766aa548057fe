"""The contract between protocol adapters and the request pipeline.

Adapters (HTTP/1.1 over httptools, HTTP/2 over h2, HTTP/3 over aioquic, gRPC-Web
on any of them) parse their protocol, enforce protocol limits (header size ->
431, body size -> 413, read timeouts -> 408: rendered by :mod:`gateway.errors`
like every other error) and hand each complete :class:`Request` to the one
:data:`Entrance` with a :class:`ResponseSink`. They never see which handler or
wire format answers, and the pipeline never sees which protocol carries it
(``request.protocol`` is informational, for metrics and logs).

The no-task path is a property of the sink's type, not something discovered at
run time: every sink can start, write and finish a response without a
coroutine (:meth:`ResponseSink.respond`, :meth:`~ResponseSink.start`,
:meth:`~ResponseSink.send_nowait`, :meth:`~ResponseSink.end`). Only a writer
whose client is not reading awaits :meth:`~ResponseSink.send`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Request", "RequestBodyStream", "ResponseSink", "Handler", "Headers", "Call", "Entrance", "StreamsBody"]

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
    # A body the handler reads as it arrives (gRPC client and bidi streaming): set, with
    # ``body`` empty, by a full-duplex adapter (HTTP/2, HTTP/3) for a request its ``StreamsBody``
    # predicate picks. Otherwise None and ``body`` is whole (HTTP/1.1 always; bounded by the limit).
    stream: RequestBodyStream | None = None
    early_data: bool = False  # arrived in TLS/QUIC 0-RTT data (replayable: RFC 8470)

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """First value of a header (``name`` lower-case)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default


class RequestBodyStream(Protocol):
    """Incremental request body (see :attr:`Request.stream`)."""

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` once it has ended. Raises
        :class:`ConnectionError` if the client reset the stream or went away, or the
        :class:`~gateway.errors.APIError` the adapter refused the rest with (413)."""
        ...


class ResponseSink(Protocol):
    """Where the pipeline writes one response.

    Exactly one of: :meth:`respond`; or :meth:`start`, then any number of
    :meth:`send_nowait` / :meth:`send`, then :meth:`end` or :meth:`abort`.
    Nothing but :meth:`send` waits: output that flow control holds back is queued
    by the adapter and sent as the peer's window opens (a whole response is
    bounded by what the pipeline built; a stream is bounded because the writer
    stops at ``send_nowait() == False`` until :meth:`send` returns).
    """

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A complete response in one go (the adapter frames its length)."""
        ...

    def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed response (chunked in h1, DATA frames in h2/h3)."""
        ...

    def send_nowait(self, data: bytes) -> bool:
        """Write ``data`` if that needs no waiting and return True; return False, writing
        nothing, while the peer is not reading (or is gone): the caller then awaits
        :meth:`send` with the same data."""
        ...

    async def send(self, data: bytes) -> None:
        """Write ``data``, waiting while the peer's window / socket buffer is full; raises
        :class:`ConnectionError` if the client went away."""
        ...

    def end(self, trailers: Headers | None = None) -> None:
        """End a streamed response (after anything queued). ``trailers``: HTTP trailer fields
        (native gRPC's status) where the protocol carries them (h2, h3: a trailing HEADERS
        frame); HTTP/1.1 drops them (its clients here read none)."""
        ...

    def abort(self) -> None:
        """The started response cannot be completed: cut it so the client sees it broke
        (h1: close the connection; h2/h3: reset the stream)."""
        ...


class Call(Protocol):
    """A request the pipeline has taken (a task or a callback-driven generation call)."""

    def cancel(self) -> object:
        """The client went away: stop (cancel the worker request). ``done`` still comes, once."""
        ...


Entrance = Callable[[Request, ResponseSink, Callable[[], None]], Call]
"""The one way in: ``entrance(request, sink, done) -> Call``.

The pipeline takes every request: it answers through ``sink`` (errors included)
and calls ``done()`` exactly once when the response has ended, never from inside
the ``entrance`` call itself (adapters start the next pipelined request from
``done``). The adapter calls ``call.cancel()`` if the client goes away first.
"""

StreamsBody = Callable[[Request], bool]
"""Declared by the entrance's side and given to a listener at construction: does this request
(headers only, ``body`` empty) want its body as a stream? Asked once per request that has a body,
at HEADERS, by adapters that can stream it; the others read every body whole."""

Handler = Callable[[Request, ResponseSink], Awaitable[None]]
"""A coroutine route; :func:`gateway.http.common.task_entrance` makes it an :data:`Entrance`."""
