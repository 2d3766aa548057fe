"""The small async interface both sides of the transport program against.

Gateway side::

    conn = await transport.client.connect("tcp://127.0.0.1:7000", identity="gw-1")
    conn.peer_hello.models            # what the worker serves
    stream = conn.submit(Submit(request_id=conn.next_request_id(), model="tiny", ...))
    while True:
        events = await stream.next_events()   # list[TokenEntry | Finish | Error]
        ...                                   # the last event of a stream is Finish or Error
    stream.cancel()                           # sends Cancel; stream then ends once

Worker side::

    server = await transport.server.serve("tcp://0.0.0.0:7000", handler)
    # handler implements WorkerHandler below; it gets a ServerConnection per peer
    ...
    await server.close()

Both sides: heartbeats (Ping/Pong) and a dead-peer timeout live in
``transport.flow``; when the peer dies every open stream ends with
``Error(code=CONNECTION_LOST)`` exactly once and ``conn.closed`` is set.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from .messages import Error, Finish, Hello, KvEvents, Stats, Submit, TokenBatch, TokenEntry

__all__ = ["RequestStream", "WorkerConnection", "KvEventSource", "ServerConnection", "WorkerHandler", "Server", "StreamEvent",
           "Collected", "Received"]

StreamEvent = TokenEntry | Finish | Error


class Collected(NamedTuple):
    """What :meth:`ClientStream.collect` returns: the whole request, once it ended."""

    text: bytes  # every text delta, joined
    tokens: int  # token ids received
    first_token_at: float  # time.perf_counter() when the first token arrived; 0.0 if none did
    final: Finish | Error


class Received(NamedTuple):
    """What a stream that ended in an error had received (:meth:`RequestStream.received`)."""

    token_ids: array[int]  # 'I', in order
    text_bytes: int  # bytes of their text deltas


class RequestStream(Protocol):
    """One request's results on the gateway side."""

    request_id: int

    async def next_events(self) -> list[StreamEvent]:
        """Wait for and return every buffered event (at least one).

        Draining grants the worker more credit. After the final Finish/Error has
        been returned, further calls raise ``StopAsyncIteration``.
        """
        ...

    def wait(self) -> asyncio.Future[None]:
        """Resolves once an event is waiting (pull mode driven by callbacks; see :meth:`take_events`)."""
        ...

    def take_events(self) -> list[StreamEvent]:
        """Every event waiting now (possibly none); grants credit like :meth:`next_events`."""
        ...

    def collect(self) -> asyncio.Future[Collected]:
        """Whole-response mode: text deltas buffered in the stream, one wake-up at the end."""
        ...

    def listen(self, on_text: Callable[[bytes], bool]) -> asyncio.Future[Finish | Error | None]:
        """Push mode: ``on_text`` per engine step; resolves to the final event, or None once
        ``on_text`` returned False (the consumer's client is slow: listen again later)."""
        ...

    def unlisten(self) -> None:
        """Leave push mode (idempotent)."""
        ...

    def cancel(self) -> None:
        """Send Cancel (idempotent). The stream still ends exactly once."""
        ...

    def received(self) -> Received | None:
        """Once the stream ended with an error: every token it received and the bytes of their
        text (what a second replica resumes from); None otherwise, or when its history is gone."""
        ...

    @property
    def done(self) -> bool: ...


class WorkerConnection(Protocol):
    """Gateway's connection to one worker."""

    peer_hello: Hello
    latest_stats: Stats | None
    closed: bool
    draining: bool  # the worker said Goodbye: no new requests

    def next_request_id(self) -> int: ...

    def submit(self, submit: Submit) -> RequestStream:
        """Send a Submit; raise ``transport.errors.ConnectionClosed`` if closed."""
        ...

    @property
    def in_flight(self) -> int: ...

    async def drain(self, timeout: float) -> None:
        """Send Goodbye, wait for in-flight streams to end (up to timeout)."""
        ...

    async def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


@runtime_checkable
class KvEventSource(Protocol):
    """A :class:`WorkerConnection` that can subscribe to the worker's KV events (the transport's
    client connection; an optional capability, so other connection types need not have it)."""

    def subscribe_kv(self, listener: Callable[[KvEvents], None]) -> None:
        """Only to a worker whose Hello lists ``"kv_events"``: its whole prefix cache, then every
        change, each batch to ``listener`` (again: a resync)."""
        ...


class ServerConnection(Protocol):
    """Worker's view of one gateway connection. All sends are non-blocking and
    coalesced per event-loop iteration."""

    peer_hello: Hello
    closed: bool

    def send_tokens(self, batch: TokenBatch) -> None: ...

    def send_finish(self, finish: Finish) -> None: ...

    def send_error(self, error: Error) -> None: ...

    def send_stats(self, stats: Stats) -> None: ...

    def send_kv_events(self, events: KvEvents) -> None:
        """Only after :meth:`WorkerHandler.on_kv_subscribe` for this connection."""
        ...

    def credit(self, request_id: int) -> int:
        """Tokens the worker may still send for this request (flow control)."""
        ...


class WorkerHandler(Protocol):
    """Implemented by the worker (inference.worker)."""

    def hello(self) -> Hello: ...

    def on_submit(self, conn: ServerConnection, submit: Submit) -> None: ...

    def on_cancel(self, conn: ServerConnection, request_id: int) -> None: ...

    def on_credit(self, conn: ServerConnection, request_id: int, available: int) -> None:
        """Credit for a request rose from 0 (it may be resumed)."""
        ...

    def on_disconnect(self, conn: ServerConnection, open_requests: Sequence[int]) -> None:
        """Peer gone: the worker cancels these requests (no sends needed)."""
        ...

    def on_kv_subscribe(self, conn: ServerConnection) -> None:
        """The gateway asks for the prefix cache's changes (only if our Hello lists ``"kv_events"``):
        send the whole set now, then every change."""
        ...


class Server(Protocol):
    @property
    def address(self) -> str:
        """The URL actually bound, e.g. ``tcp://127.0.0.1:41234``."""
        ...

    async def close(self) -> None: ...
