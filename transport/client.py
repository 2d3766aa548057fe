"""Gateway side: :func:`connect` returns a :class:`~transport.api.WorkerConnection`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

from .api import RequestStream, StreamEvent, WorkerConnection
from .endpoint import Endpoint
from .errors import ConnectError, ConnectionClosed, ProtocolError
from .flow import (
    ConnectionEnded,
    Event,
    FlowConnection,
    GoodbyeReceived,
    PeerHello,
    RequestEnded,
    StatsReceived,
    TokensReceived,
)
from .messages import Error, ErrorCode, Finish, Hello, Stats, Submit, TokenBatch, TokenEntry
from .select import choose
from .tcp import open_stream

__all__ = ["connect", "ClientConnection", "ClientStream", "Collected"]


class Collected(NamedTuple):
    """What :meth:`ClientStream.collect` returns: the whole request, once it ended."""

    text: bytes  # every text delta, joined
    tokens: int  # token ids received
    first_token_at: float  # time.perf_counter() when the first token arrived; 0.0 if none did
    final: Finish | Error


class ClientStream:
    """One request's events; draining them grants the worker more credit.

    Two ways to consume: :meth:`next_events` wakes the consumer once per engine
    step (streaming responses), :meth:`collect` buffers text deltas in the
    stream and wakes it once, at the end (whole responses). Either way credit
    is granted back as tokens are consumed, in batches of half a window.
    """

    __slots__ = ("request_id", "_conn", "_events", "_waiter", "_ended", "_final_returned", "_unacked",
                 "_parts", "_ntok", "_t_first", "_collector", "_extras", "_listener", "_listen_fut")

    def __init__(self, conn: ClientConnection, request_id: int, extras: bool = False) -> None:
        self.request_id = request_id
        self._conn = conn
        self._events: list[StreamEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._final_returned = False
        self._unacked = 0  # consumed tokens not yet handed to the core (batched like its Credit)
        self._parts: list[bytes] | None = None  # collect mode: text deltas
        self._ntok = 0
        self._t_first = 0.0
        self._collector: asyncio.Future[Collected] | None = None
        self._extras = extras  # the request asked for logprobs: collect() and listen() cannot pass them on
        self._listener: Callable[[bytes], bool] | None = None  # listen mode: called per text delta
        self._listen_fut: asyncio.Future[Finish | Error | None] | None = None

    @property
    def done(self) -> bool:
        return self._ended

    def _push(self, ev: StreamEvent) -> None:
        self._events.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, ev: Finish | Error) -> None:
        if self._ended:  # the core guarantees once; this keeps the stream honest anyway
            return
        self._ended = True
        if self._listener is not None:
            self._listener = None
            self._final_returned = True
            if self._unacked:
                self._grant()
            lf = self._listen_fut
            if lf is not None and not lf.done():
                lf.set_result(ev)
            return
        parts = self._parts
        if parts is None:
            self._push(ev)
            return
        self._final_returned = True
        if self._unacked:
            self._grant()
        fut = self._collector
        if fut is not None and not fut.done():
            text = parts[0] if len(parts) == 1 else b"".join(parts)
            fut.set_result(Collected(text, self._ntok, self._t_first, ev))

    def _grant(self) -> None:
        n, self._unacked = self._unacked, 0
        self._conn._consumed(self.request_id, n)

    async def next_events(self) -> list[StreamEvent]:
        if self._final_returned or self._parts is not None:
            raise StopAsyncIteration
        while not self._events:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        ntok = 0
        for ev in events:
            if type(ev) is TokenEntry:
                ntok += len(ev.token_ids)
        if ntok:
            self._unacked += ntok
            if self._unacked >= self._conn._grant_batch:
                self._grant()
        if self._ended and not self._events:
            self._final_returned = True
        return events

    def collect(self) -> asyncio.Future[Collected]:
        """Wait for the end of the request with no wake-up per engine step.

        From now on the stream appends each step's text delta to a buffer (and
        grants credit) as it arrives; the returned future resolves once, with
        the joined text, the token count, when the first token came and the
        final Finish/Error. Events :meth:`next_events` has not returned yet are
        included. Not for requests that asked for logprobs (``ValueError``):
        those are only kept per entry.
        """
        if self._extras:
            raise ValueError("collect() keeps text only; this request asked for logprobs")
        if self._parts is not None or self._final_returned:
            raise RuntimeError("collect() after the stream was collected or fully read")
        fut: asyncio.Future[Collected] = self._conn.loop.create_future()
        parts: list[bytes] = []
        final: Finish | Error | None = None
        for ev in self._events:
            if type(ev) is TokenEntry:
                parts.append(bytes(ev.text))
                n = len(ev.token_ids)
                self._ntok += n
                self._unacked += n
                if not self._t_first:
                    self._t_first = time.perf_counter()
            else:
                final = ev  # type: ignore[assignment]
        self._events = []
        self._parts = parts
        self._collector = fut
        if final is not None:
            self._ended = False  # let _end resolve the future with what was buffered
            self._end(final)
        elif self._unacked >= self._conn._grant_batch:
            self._grant()
        return fut

    def listen(self, on_text: Callable[[bytes], bool]) -> asyncio.Future[Finish | Error | None]:
        """Push mode: ``on_text(delta)`` runs synchronously as each engine step's text arrives.

        For streamed responses whose consumer can write without waiting: the
        consumer is not woken per step at all. ``on_text`` returns True to keep
        receiving, or False when it cannot take more now (its client is slow);
        the stream then stops calling it and buffers, and the future resolves
        to ``None`` -- the consumer waits for its client and calls ``listen``
        again (buffered deltas are delivered first) or :meth:`next_events`.
        Otherwise the future resolves once, to the final Finish/Error. Credit
        is granted for every delta handed to ``on_text``. If ``on_text``
        raises, the future gets the exception. Not for logprob requests
        (``ValueError``).
        """
        if self._extras:
            raise ValueError("listen() passes text only; this request asked for logprobs")
        if self._parts is not None or self._final_returned or self._listener is not None:
            raise RuntimeError("listen() on a stream that is collected, fully read or already listening")
        fut: asyncio.Future[Finish | Error | None] = self._conn.loop.create_future()
        events, self._events = self._events, []
        for i, ev in enumerate(events):
            if type(ev) is not TokenEntry:
                self._final_returned = True
                fut.set_result(ev)  # type: ignore[arg-type]
                break
            self._unacked += len(ev.token_ids)
            if not on_text(ev.text):
                self._events = events[i + 1:]
                fut.set_result(None)
                break
        else:
            self._listener = on_text
            self._listen_fut = fut
        if self._unacked >= self._conn._grant_batch or (self._unacked and self._final_returned):
            self._grant()
        return fut

    def unlisten(self) -> None:
        """Leave push mode (idempotent); later deltas buffer for :meth:`next_events`."""
        self._listener = None
        lf, self._listen_fut = self._listen_fut, None
        if lf is not None and not lf.done():
            lf.cancel()

    def _listener_failed(self, exc: BaseException | None) -> None:
        """``on_text`` said stop (``exc`` None) or raised: leave push mode, tell the consumer."""
        self._listener = None
        lf, self._listen_fut = self._listen_fut, None
        if lf is not None and not lf.done():
            if exc is None:
                lf.set_result(None)
            else:
                lf.set_exception(exc)

    def cancel(self) -> None:
        self._conn._cancel(self.request_id)


class ClientConnection:
    """A gateway's connection to one worker (implements ``WorkerConnection``)."""

    def __init__(self, core: FlowConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.loop = loop
        self.endpoint = Endpoint(core, loop, self._on_events)
        self.peer_hello: Hello = Hello()
        self.latest_stats: Stats | None = None
        self.closed = False
        self.draining = False
        self._hello: asyncio.Future[None] = loop.create_future()
        self._streams: dict[int, ClientStream] = {}
        self._next_id = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Consumed tokens are handed to the core in batches of this size; the core
        # itself grants Credit at half a window, so this sends exactly the same frames.
        self._grant_batch = max(1, core.local_hello.initial_credit // 2)

    # --- WorkerConnection --------------------------------------------------------------------

    def next_request_id(self) -> int:
        while True:
            self._next_id = self._next_id % 0xFFFF_FFFF + 1
            if self._next_id not in self._streams and not self.core.is_open(self._next_id):
                return self._next_id

    def submit(self, submit: Submit) -> RequestStream:
        if self.closed:
            raise ConnectionClosed("connection to worker is closed")
        self.core.submit(submit)
        p = submit.params
        stream = ClientStream(self, submit.request_id, bool(p.logprobs or p.top_logprobs))
        self._streams[submit.request_id] = stream
        self._idle.clear()
        self.endpoint.flush_soon()
        return stream

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float) -> None:
        self.core.goodbye("gateway draining")
        self.endpoint.flush_soon()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        await self.close()

    async def close(self) -> None:
        self.endpoint.close("connection closed by the gateway")
        await self.wait_closed()
        await asyncio.sleep(0)  # the channel itself closes on the next loop iteration

    async def wait_closed(self) -> None:
        await self.endpoint.closed_event.wait()

    # --- internals ---------------------------------------------------------------------------

    def _consumed(self, rid: int, tokens: int) -> None:
        self.core.consumed(rid, tokens)
        if self.core.has_data_to_send:
            self.endpoint.flush_soon()

    def _cancel(self, rid: int) -> None:
        if rid in self._streams:
            self.endpoint.deliver(self.core.cancel(rid))

    def _text_entry(self, st: ClientStream, text: bytes, n: int) -> None:
        """One entry for a collecting or listening stream (the general path; see _on_tokens)."""
        st._unacked += n
        if st._parts is not None:
            st._parts.append(text)
            st._ntok += n
            if not st._t_first:
                st._t_first = time.perf_counter()
        elif st._listener is not None:
            try:
                if not st._listener(text):
                    st._listener_failed(None)
            except Exception as exc:
                st._listener_failed(exc)
        if st._unacked >= self._grant_batch:
            st._grant()

    def _on_tokens(self, batch: TokenBatch) -> None:
        """Hand one engine step's tokens to their streams, walking the packed arrays.

        Collecting streams get their text slice appended (no per-entry object);
        the others get a :class:`TokenEntry`. Batches with logprobs take the
        general path (:meth:`TokenBatch.entries`).
        """
        streams = self._streams
        if batch.has_logprobs or batch.top_ns:
            for entry in batch.entries():
                st = streams.get(entry.request_id)
                if st is not None:
                    if st._parts is not None or st._listener is not None:  # a text-only neighbour
                        self._text_entry(st, entry.text, len(entry.token_ids))
                    else:
                        st._push(entry)
            return
        text = batch.text
        grant = self._grant_batch
        tok: memoryview | None = None
        t = s = 0
        for rid, n, ln in zip(batch.request_ids, batch.counts, batch.text_lens, strict=True):
            st = streams.get(rid)
            if st is not None:
                parts = st._parts
                if parts is not None:
                    parts.append(text[s : s + ln])
                    st._ntok += n
                    if not st._t_first:
                        st._t_first = time.perf_counter()
                    st._unacked += n
                    if st._unacked >= grant:
                        st._grant()
                elif st._listener is not None:
                    st._unacked += n
                    if st._unacked >= grant:
                        st._grant()
                    try:
                        if not st._listener(text[s : s + ln]):
                            st._listener_failed(None)
                    except Exception as exc:  # the consumer's bug must not break the connection
                        st._listener_failed(exc)
                else:
                    if tok is None:
                        tok = memoryview(batch.token_ids)
                    st._push(TokenEntry(rid, tok[t : t + n], text[s : s + ln], None, None, None))
            t += n
            s += ln

    def _on_events(self, events: list[Event]) -> None:
        streams = self._streams
        for ev in events:
            if isinstance(ev, TokensReceived):
                self._on_tokens(ev.batch)
            elif isinstance(ev, RequestEnded):
                st = streams.pop(ev.result.request_id, None)
                if st is not None:
                    st._end(ev.result)
                if not streams:
                    self._idle.set()
            elif isinstance(ev, StatsReceived):
                self.latest_stats = ev.stats
            elif isinstance(ev, PeerHello):
                self.peer_hello = ev.hello
                if not self._hello.done():
                    self._hello.set_result(None)
            elif isinstance(ev, GoodbyeReceived):
                self.draining = True
            elif isinstance(ev, ConnectionEnded):
                self.closed = True
                for st in list(streams.values()):  # the core ended them; belt and braces
                    st._end(Error(st.request_id, ErrorCode.CONNECTION_LOST, ev.error.message))
                streams.clear()
                self._idle.set()
                if not self._hello.done():
                    exc_type = ProtocolError if ev.error.code == ErrorCode.PROTOCOL else ConnectError
                    self._hello.set_exception(exc_type(ev.error.message))


async def connect(
    url: str,
    *,
    identity: str = "",
    timeout: float = 10.0,
    heartbeat_interval: float = 1.0,
    dead_after: float = 5.0,
    rdma_required: bool = False,
    initial_credit: int = 256,
) -> WorkerConnection:
    """Connect to a worker at ``url`` and complete the HELLO exchange."""
    choice = choose(url, rdma_required=rdma_required)
    loop = asyncio.get_running_loop()
    hello = Hello(role="gateway", identity=identity, initial_credit=initial_credit)
    core = FlowConnection(
        "gateway", hello, loop.time(), heartbeat_interval=heartbeat_interval, dead_after=dead_after
    )
    conn = ClientConnection(core, loop)
    t = choice.target
    try:
        async with asyncio.timeout(timeout):
            if choice.kind == "rdma":
                from .rdma import rdma_connect

                await rdma_connect(t.host, t.port, lambda: conn.endpoint)
            else:
                await open_stream(t.scheme, t.host, t.port, t.path, lambda: conn.endpoint)
            await conn._hello
    except TimeoutError:
        conn.endpoint.close("connect timeout")
        raise ConnectError(f"{url}: no HELLO from the worker within {timeout}s") from None
    except OSError as exc:
        conn.endpoint.close("connect failed")
        raise ConnectError(f"{url}: {exc.strerror or exc}") from exc
    except BaseException:  # protocol error at HELLO, or the caller gave up: leave nothing open
        conn.endpoint.close("connect aborted")
        raise
    return conn
