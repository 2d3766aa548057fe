"""Binds a sans-I/O :class:`FlowConnection` to a byte channel in an event loop.

Every channel (TCP, Unix socket, RDMA) gives the endpoint bytes with
:meth:`Endpoint.data_received` and takes bytes through :class:`ByteSink`.
The endpoint coalesces writes: whatever the core queues during one loop
iteration goes out in one ``write`` from a single ``call_soon`` callback.
One timer is armed at the core's deadline; firing early is harmless, so the
timer is only moved when the deadline comes sooner. A layer above the core
that coalesces its own sends (the worker's :class:`~transport.hold.ResultHold`)
passes ``before_flush``: it runs before the core's bytes are taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from .flow import ConnectionEnded, Event, FlowConnection

__all__ = ["ByteSink", "Endpoint"]


class ByteSink(Protocol):
    """The write side of a channel."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Endpoint:
    """Feed, process events, flush, arm the timer (the whole adapter)."""

    def __init__(
        self,
        core: FlowConnection,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[list[Event]], None],
        before_flush: Callable[[], None] | None = None,
    ) -> None:
        self.core = core
        self.loop = loop
        self._on_events = on_events
        self._before_flush = before_flush
        self._sink: ByteSink | None = None
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.closed_event = asyncio.Event()
        self.peer = ""  # the peer's address, for logs (its channel sets it)

    def attach(self, sink: ByteSink) -> None:
        self._sink = sink
        self.flush_soon()
        self._arm()

    # --- from the channel -------------------------------------------------------------------

    def data_received(self, data: bytes | bytearray | memoryview) -> None:
        events = self.core.receive_data(data, self.loop.time())
        self._after(events)

    def channel_lost(self, reason: str) -> None:
        self._after(self.core.connection_lost(reason))

    # --- from the application ---------------------------------------------------------------

    def deliver(self, events: list[Event]) -> None:
        """Process events a local call on the core returned (and flush)."""
        self._after(events)

    def flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def close(self, reason: str = "connection closed") -> None:
        self._after(self.core.close(reason))

    # --- internals --------------------------------------------------------------------------

    def _after(self, events: list[Event]) -> None:
        if self.core.has_data_to_send:
            self.flush_soon()
        if events:
            self._on_events(events)
            if self.core.has_data_to_send:
                self.flush_soon()
            for ev in events:
                if isinstance(ev, ConnectionEnded):
                    self._shutdown()
                    break
        self._arm()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._before_flush is not None:
            self._before_flush()
        data = self.core.data_to_send()
        if data and self._sink is not None:
            self._sink.write(data)
        if self.core.closed:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.closed_event.is_set():
            return
        self.closed_event.set()
        # Let a final frame (our Error/Goodbye) go out before the channel closes.
        self.loop.call_soon(self._close_sink)

    def _close_sink(self) -> None:
        if self._before_flush is not None:
            self._before_flush()
        data = self.core.data_to_send()
        if self._sink is not None:
            if data:
                self._sink.write(data)
            self._sink.close()

    def _arm(self) -> None:
        when = self.core.get_timer()
        if when is None:
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._after(self.core.handle_timer(self.loop.time()))
