"""The waiting room: where requests for a model with no ready replica wait while one starts.

How it works: a :class:`WaitingRoom` stands in the pool for a replica of its model (the elastic
pool's routing hands it out only when no real replica can take a request, and only if the room has
space and the replica starting now should be ready before the room's timeout). It looks like a
worker connection that never answers: its :meth:`WaitingRoom.submit` opens a :class:`WaitingStream`
that carries no token. When a replica becomes ready, :meth:`WaitingRoom.release` moves every waiting
request there, oldest first, the way a rebalance moves requests queued on a busy replica
(:meth:`~gateway.routing.routed.RoutedStream.move`): the consumer reads the new stream and the
client sees an ordinary, if late, answer. A request still waiting at the room's timeout ends with
OVERLOADED (its routed stream tries the pool once more, then the client gets 503). Sans-I/O but for
the futures its streams hand out; the clock is passed in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from transport.api import Collected, Received, StreamEvent, WorkerConnection
from transport.errors import ConnectionClosed
from transport.messages import Error, ErrorCode, Finish, Hello, KvEvents, Stats, Submit

from ..routing.pool import ModelPool

__all__ = ["WaitingRoom", "WaitingStream"]


class WaitingStream:
    """A request in the waiting room: no token ever; one end (moved away, cancelled, or timed out)."""

    __slots__ = ("request_id", "since", "_room", "_end", "_returned")

    def __init__(self, room: WaitingRoom, request_id: int, since: float) -> None:
        self.request_id = request_id
        self.since = since  # when it came in (the room's clock)
        self._room = room
        self._end: asyncio.Future[Error] = asyncio.get_running_loop().create_future()
        self._returned = False

    @property
    def done(self) -> bool:
        return self._end.done()

    def finish(self, code: ErrorCode, message: str) -> None:
        self._room.streams.pop(self.request_id, None)
        if not self._end.done():
            self._end.set_result(Error(self.request_id, code, message))

    def _then(self, value: Callable[[Error], object]) -> asyncio.Future[object]:
        out: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        def ended(end: asyncio.Future[Error]) -> None:
            if not out.done():
                out.set_result(value(end.result()))

        self._end.add_done_callback(ended)
        return out

    async def next_events(self) -> list[StreamEvent]:
        if self._returned:
            raise StopAsyncIteration
        err = await asyncio.shield(self._end)
        self._returned = True
        return [err]

    def wait(self) -> asyncio.Future[None]:
        return self._then(lambda _: None)  # type: ignore[return-value]

    def take_events(self) -> list[StreamEvent]:
        if not self._end.done() or self._returned:
            return []
        self._returned = True
        return [self._end.result()]

    def collect(self) -> asyncio.Future[Collected]:
        return self._then(lambda err: Collected(b"", 0, 0.0, err))  # type: ignore[return-value]

    def listen(self, on_text: Callable[[bytes], bool]) -> asyncio.Future[Finish | Error | None]:
        return self._then(lambda err: err)  # type: ignore[return-value]

    def unlisten(self) -> None:
        pass  # nothing is ever pushed

    def cancel(self) -> None:
        self.finish(ErrorCode.CANCELLED, "cancelled while waiting for a replica")

    def received(self) -> Received | None:
        return None  # nothing was received: a request never resumes from here


class WaitingRoom:
    """Requests for ``model`` waiting for its first replica (a :class:`~transport.api.WorkerConnection`
    to the pool). ``size``: how many may wait; ``timeout``: how long each may."""

    latest_stats: Stats | None = None
    closed = False
    draining = False

    def __init__(self, model: str, size: int, timeout: float, now: Callable[[], float],
                 on_arrival: Callable[[], None] | None = None) -> None:
        self.model = model
        self.size = size
        self.timeout = timeout
        self._now = now
        self.on_arrival = on_arrival  # a request came in (the elastic pool starts a replica at once)
        self.eta: Callable[[], float | None] = lambda: None  # seconds until a replica should be ready (None: unknown)
        self.peer_hello = Hello(role="worker", identity=f"waiting room of {model}", models=(model,))
        self.streams: dict[int, WaitingStream] = {}  # by request id, oldest first
        self._rid = 0
        self.admitted = 0  # requests that waited here, ever
        self.timed_out = 0  # ... that reached the timeout

    def can_take(self) -> bool:
        """Room for one more, and a replica expected before its timeout (or no estimate yet)."""
        if len(self.streams) >= self.size:
            return False
        eta = self.eta()
        return eta is None or eta <= self.timeout

    @property
    def conn(self) -> WorkerConnection:
        """The room as the pool sees it: one more connection of its model."""
        return self

    def next_request_id(self) -> int:
        self._rid += 1
        return self._rid

    def submit(self, submit: Submit) -> WaitingStream:
        if len(self.streams) >= self.size:
            raise ConnectionClosed(f"the waiting room of {self.model} is full")
        st = self.streams[submit.request_id] = WaitingStream(self, submit.request_id, self._now())
        self.admitted += 1
        if self.on_arrival is not None:
            self.on_arrival()
        return st

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def oldest_wait(self, now: float) -> float:
        first = next(iter(self.streams.values()), None)
        return now - first.since if first is not None else 0.0

    def expire(self, now: float) -> int:
        """End every request that has waited ``timeout``: OVERLOADED. Returns how many."""
        late = [st for st in self.streams.values() if now - st.since >= self.timeout]
        for st in late:
            st.finish(ErrorCode.OVERLOADED, f"no replica of {self.model} became ready within {self.timeout:g} s")
        self.timed_out += len(late)
        return len(late)

    def release(self, pool: ModelPool) -> int:
        """Move every waiting request to a ready replica the pool's policy picks, oldest first. Returns
        how many moved."""
        moved = 0
        for routed in list(pool.unstarted.get(self.conn, ())):
            target = pool.choose(self.model, routed.subject, (self.conn,), None)
            if target is None:
                break
            if routed.on_moved is None:  # a shadow copy reads the stream itself: it ends here
                if routed.stream is not None:
                    routed.stream.cancel()
                continue
            moved += routed.move(target)
        return moved

    async def drain(self, timeout: float) -> None:
        pass

    def subscribe_kv(self, listener: Callable[[KvEvents], None]) -> None:
        raise ValueError("a waiting room holds no KV cache")  # its Hello lists no kv_events

    async def close(self) -> None:
        for st in list(self.streams.values()):
            st.finish(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down")

    async def wait_closed(self) -> None:
        await asyncio.Future()  # never: the room lives as long as its pool

