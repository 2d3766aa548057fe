"""An HTTP/2 request body the call reads as it arrives (``Request.stream``), full duplex.

How it works: the adapter feeds each DATA frame in (:meth:`H2BodyStream.feed`) without
acknowledging it; :meth:`~H2BodyStream.read` hands out one piece and only then acknowledges its
flow-controlled length (padding included) to h2, which sends WINDOW_UPDATE as consumption
passes its threshold. So what a client can have sent and we hold unread is bounded by the
stream window we advertise (``HttpLimits.h2_initial_window_size``), and a handler that stops
reading stops the upload. The body limit still applies: past it the body fails with a 413
:class:`~gateway.errors.APIError` (the call answers it; the adapter then stops the upload). A
reset stream or a lost connection fails it with :class:`~gateway.http.common.ClientDisconnected`.
A failed body raises its error from the next :meth:`~H2BodyStream.read`; the pieces it still
held are dropped and acknowledged, so the connection window is not lost with them.

The connection window is shared: bodies that are fed but never read hold it until their call
ends (16 MiB by default, against a stream window of 1 MiB).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import h2.connection

from gateway.http.common import protocol_error

__all__ = ["H2BodyStream"]


class H2BodyStream:
    """:class:`~gateway.http.types.RequestBodyStream` over one HTTP/2 stream's DATA frames."""

    __slots__ = ("_h2", "_sid", "_flush", "_limit", "_received", "_pieces", "_ended", "_error", "_waiter")

    def __init__(self, conn: h2.connection.H2Connection, stream_id: int, flush: Callable[[], None],
                 limit: int) -> None:
        self._h2 = conn
        self._sid = stream_id
        self._flush = flush  # schedules sending what h2 has queued (its WINDOW_UPDATEs)
        self._limit = limit  # the body limit (HttpLimits.max_body_bytes)
        self._received = 0
        self._pieces: deque[tuple[bytes, int]] = deque()  # (data, flow-controlled length)
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def open(self) -> bool:
        """Still taking DATA: not ended by the client, not failed."""
        return not self._ended and self._error is None

    def feed(self, data: bytes, flow_length: int) -> bool:
        """One DATA frame; False if it took the body past the limit (the body has failed: 413)."""
        self._received += len(data)
        self._pieces.append((data, flow_length))
        if self._received > self._limit:
            self.fail(protocol_error(413, f"request body exceeds {self._limit} bytes"))
            return False
        self._wake()
        return True

    def end(self) -> None:
        """The client ended its side (END_STREAM)."""
        self._ended = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Fail the body (the first error wins); what it held is dropped and acknowledged."""
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
                    return data
                continue  # a DATA frame of padding only
            if self._ended:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _ack(self, n: int) -> None:
        if n:
            self._h2.acknowledge_received_data(n, self._sid)
            self._flush()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
