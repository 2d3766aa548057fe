"""A request body the call reads as it arrives (``Request.stream``): full duplex over HTTP/2 and
HTTP/3.

How it works: the adapter feeds each piece of the body in as it arrives (:meth:`BodyStream.feed`)
and :meth:`~BodyStream.read` hands them out in order. What a client may have sent and we hold
unread is bounded by flow control where the adapter ties it to reading (HTTP/2:
:class:`H2BodyStream` acknowledges DATA to h2 only as it is read, so a handler that stops reading
stops the upload at the stream window) and by the body limit in any case: past it the body fails
with a 413 :class:`~gateway.errors.APIError` (the call answers it; the adapter then stops or drops
the upload). A reset stream or a lost connection fails it with a :class:`ConnectionError`. A
failed body raises its error from the next read; the pieces it still held are dropped (and, over
HTTP/2, acknowledged, so the connection window is not lost with them).

HTTP/3: aioquic credits QUIC flow control as data arrives and has no public way to hold it
back, so there the body limit alone bounds what is held (as it bounds a body read whole).
HTTP/2: the connection window is shared: bodies fed but never read hold it until their call
ends (16 MiB by default, against a stream window of 1 MiB).

Pieces are held joined, up to :data:`PIECE` bytes each: flow control counts payload bytes, and a
client sending DATA frames of one byte (or none, with padding) must not make each byte of
window cost a tuple and an object (about 100 bytes of memory per byte held).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import h2.connection

from gateway.http.common import protocol_error

__all__ = ["BodyStream", "H2BodyStream", "PIECE"]

PIECE = 16 << 10  # small pieces are joined up to this size while they wait to be read


class BodyStream:
    """:class:`~gateway.http.types.RequestBodyStream` fed by an adapter."""

    __slots__ = ("_limit", "_received", "_pieces", "_ended", "_error", "_waiter")

    def __init__(self, limit: int) -> None:
        self._limit = limit  # the body limit (HttpLimits.max_body_bytes)
        self._received = 0
        self._pieces: deque[tuple[bytes | bytearray, int]] = deque()  # (data, flow-controlled length)
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def open(self) -> bool:
        """Still taking data: not ended by the client, not failed."""
        return not self._ended and self._error is None

    @property
    def ended(self) -> bool:
        """The client ended its side (whether or not the body has been read to its end)."""
        return self._ended

    def feed(self, data: bytes, flow_length: int = 0) -> bool:
        """One piece; False if it took the body past the limit (the body has failed: 413)."""
        self._received += len(data)
        pieces = self._pieces
        if pieces and len(pieces[-1][0]) + len(data) <= PIECE:  # joined to the last unread piece
            held, n = pieces[-1]
            if type(held) is not bytearray:
                held = bytearray(held)
            held += data
            pieces[-1] = (held, n + flow_length)
        else:
            pieces.append((data, flow_length))
        if self._received > self._limit:
            self.fail(protocol_error(413, f"request body exceeds {self._limit} bytes"))
            return False
        self._wake()
        return True

    def end(self) -> None:
        """The client ended its side."""
        self._ended = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Fail the body (the first error wins); what it held is dropped (and acknowledged)."""
        if self._error is None:
            self._error = error
        self._ack(sum(n for _, n in self._pieces))
        self._pieces.clear()
        self._wake()

    async def read(self) -> bytes:
        """The next piece of the body; ``b""`` once the client has ended it."""
        while True:
            if self._error is not None:
                raise self._error
            if self._pieces:
                data, n = self._pieces.popleft()
                self._ack(n)
                if data:
                    return data if type(data) is bytes else bytes(data)
                continue  # a frame of padding only
            if self._ended:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _ack(self, n: int) -> None:
        """``n`` flow-controlled bytes were read or dropped (where flow control waits for that)."""

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class H2BodyStream(BodyStream):
    """One HTTP/2 stream's DATA, acknowledged to h2 as it is read (h2 sends WINDOW_UPDATE as
    consumption passes its threshold)."""

    __slots__ = ("_h2", "_sid", "_flush")

    def __init__(self, conn: h2.connection.H2Connection, stream_id: int, flush: Callable[[], None],
                 limit: int) -> None:
        super().__init__(limit)
        self._h2 = conn
        self._sid = stream_id
        self._flush = flush  # schedules sending what h2 has queued (its WINDOW_UPDATEs)

    def _ack(self, n: int) -> None:
        if n:
            self._h2.acknowledge_received_data(n, self._sid)
            self._flush()
