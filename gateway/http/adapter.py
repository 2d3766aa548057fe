"""The asyncio side every TCP/TLS/Unix protocol adapter shares (HTTP/1.1 and HTTP/2).

How it works: a :class:`StreamAdapter` owns one transport. It registers itself with the
:class:`~gateway.http.common.ServerState` (so the listener can drain or drop it), keeps the
peer address, tracks the transport's write pause and wakes one drain waiter on resume,
coalesces output into one ``transport.write`` per loop iteration (:meth:`_flush` writes
whatever :meth:`_take_output` gives), and runs one lazy deadline timer: moving
``_deadline`` later costs an attribute store, the timer re-arms itself when it fires early,
and only a deadline moved earlier re-arms it at once. Subclasses say what a passed deadline
means (:meth:`_deadline_passed`) and what losing the connection cancels (:meth:`_lost`).
"""

from __future__ import annotations

import asyncio
import socket
from math import inf
from typing import cast

from gateway.http.common import ClientDisconnected, HttpLimits, ServerState

__all__ = ["StreamAdapter", "SinkState"]


class StreamAdapter(asyncio.Protocol):
    """Base of the HTTP adapters over a stream transport."""

    def __init__(self, state: ServerState, *, tls: bool = False) -> None:
        self._srv = state
        self._limits: HttpLimits = state.limits
        self._tls = tls
        self._scheme = "https" if tls else "http"
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._client: tuple[str, int] | None = None
        self._flush_scheduled = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._deadline = inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = inf

    # ---- what subclasses define -------------------------------------------
    def _take_output(self) -> bytes:
        """Everything ready to write (and forget it)."""
        raise NotImplementedError

    def _deadline_passed(self) -> None:
        """``_deadline`` has passed."""
        raise NotImplementedError

    def _lost(self) -> None:
        """The connection is gone: cancel what runs on it."""
        raise NotImplementedError

    def drain(self) -> None:
        """The server stops accepting: close now if idle, else after what is in flight."""
        raise NotImplementedError

    # ---- asyncio.Protocol -------------------------------------------------
    def _attach(self, transport: asyncio.BaseTransport, *, register: bool = True) -> asyncio.Transport:
        """``connection_made``'s shared part: keep the transport and the peer, register."""
        self._transport = t = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = t.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
        if register:
            self._srv.connections.add(self)
        if self._srv.limits.send_buffer:  # bound what a client that stops reading leaves in the kernel
            sock = t.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._srv.limits.send_buffer)
        return t

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._srv.connections.discard(self)
        self._stop_timer()
        self._wake_drain()  # _drain sees the transport gone and raises ClientDisconnected
        self._lost()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ---- output -----------------------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is None:
            return
        data = self._take_output()
        if data:
            self._transport.write(data)

    async def _drain(self) -> None:
        """Wait while the transport's buffer is over its high-water mark."""
        while self._write_paused:
            if self._transport is None:
                raise ClientDisconnected("client disconnected")
            if self._drain_waiter is None:
                self._drain_waiter = self._loop.create_future()
            await asyncio.shield(self._drain_waiter)
        if self._transport is None:
            raise ClientDisconnected("client disconnected")

    def _wake_drain(self) -> None:
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def _close(self) -> None:
        """Close after what is written so far."""
        self._flush()
        self._stop_timer()
        if self._transport is not None:
            self._transport.close()

    # ---- the lazy timer ---------------------------------------------------
    def _set_deadline(self, when: float) -> None:
        self._deadline = when
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(when, self._on_timer)
            self._timer_at = when

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = inf

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = inf
        if self._transport is None:
            return
        if self._deadline > self._loop.time():
            if self._deadline != inf:
                self._set_deadline(self._deadline)
            return
        self._deadline_passed()


class SinkState:
    """What every adapter's response sink tracks (``ResponseSink``'s order of calls)."""

    __slots__ = ("_head", "started", "ended")

    def __init__(self, head: bool) -> None:
        self._head = head  # a HEAD request: lengths and headers, no body bytes
        self.started = False
        self.ended = False

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True

    def _ending(self) -> bool:
        """``end()``'s check: True the first time (the response ends now), then False."""
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.ended:
            return False
        self.ended = True
        return True

    def _in_body(self, what: str) -> None:
        if not self.started or self.ended:
            raise RuntimeError(f"{what}() outside start()..end()")
