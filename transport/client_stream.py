"""The gateway side of one request: :class:`ClientStream` and how token batches reach it.

A stream is consumed in one of three ways. :meth:`ClientStream.next_events`
wakes the consumer once per engine step with :class:`TokenEntry` events (the
general case: logprobs, retries). :meth:`ClientStream.collect` buffers text
deltas inside the stream and wakes the consumer once, at the end (whole
responses). :meth:`ClientStream.listen` hands each step's text delta to a
callback synchronously, from the connection's receive path (streamed responses
written without waiting). :func:`deliver_tokens` walks one packed
:class:`TokenBatch` and feeds each stream in its mode, without a per-entry
object for the collecting and listening ones. Credit is granted back as tokens
are consumed, in batches of half a window (``grant``), in every mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from .api import Collected, Received, StreamEvent
from .messages import Error, Finish, TokenBatch, TokenEntry

__all__ = ["ClientStream", "Collected", "StreamOwner", "deliver_tokens"]


class StreamOwner(Protocol):
    """What a stream asks of its connection (:class:`~transport.client.ClientConnection`)."""

    loop: asyncio.AbstractEventLoop
    grant_batch: int  # tokens consumed before credit is granted back

    def consumed(self, rid: int, tokens: int) -> None: ...
    def cancel_request(self, rid: int) -> None: ...
    def received(self, rid: int, mark: int) -> Received | None: ...


class ClientStream:
    """One request's events; draining them grants the worker more credit.

    Two ways to consume: :meth:`next_events` wakes the consumer once per engine
    step (streaming responses), :meth:`collect` buffers text deltas in the
    stream and wakes it once, at the end (whole responses). Either way credit
    is granted back as tokens are consumed, in batches of half a window.
    """

    __slots__ = ("request_id", "_conn", "_events", "_waiter", "done", "_final_returned", "_unacked",
                 "_parts", "_ntok", "_t_first", "_collector", "_extras", "_listener", "_listen_fut", "mark",
                 "_received")

    def __init__(self, conn: StreamOwner, request_id: int, extras: bool = False, mark: int = 0) -> None:
        self.request_id = request_id
        self.mark = mark  # the connection's received-log position at submit (transport.received)
        self._received: Received | None = None  # what it had received, kept when it ended in an error
        self._conn = conn
        self._events: list[StreamEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self.done = False  # the request ended (its Finish/Error arrived, or it was cancelled)
        self._final_returned = False
        self._unacked = 0  # consumed tokens not yet handed to the core (batched like its Credit)
        self._parts: list[bytes] | None = None  # collect mode: text deltas
        self._ntok = 0
        self._t_first = 0.0
        self._collector: asyncio.Future[Collected] | None = None
        self._extras = extras  # the request asked for logprobs: collect() and listen() cannot pass them on
        self._listener: Callable[[bytes], bool] | None = None  # listen mode: called per text delta
        self._listen_fut: asyncio.Future[Finish | Error | None] | None = None

    def _push(self, ev: StreamEvent) -> None:
        self._events.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, ev: Finish | Error) -> None:
        if self.done:  # the core guarantees once; this keeps the stream honest anyway
            return
        self.done = True
        self._unacked = 0  # the request is over on the wire: there is nothing left to grant credit to
        if self._listener is not None:
            self._listener = None
            self._final_returned = True
            lf = self._listen_fut
            if lf is not None and not lf.done():
                lf.set_result(ev)
            return
        parts = self._parts
        if parts is None:
            self._push(ev)
            return
        self._final_returned = True
        fut = self._collector
        if fut is not None and not fut.done():
            text = parts[0] if len(parts) == 1 else b"".join(parts)
            fut.set_result(Collected(text, self._ntok, self._t_first, ev))

    def _grant(self) -> None:
        n, self._unacked = self._unacked, 0
        self._conn.consumed(self.request_id, n)

    async def next_events(self) -> list[StreamEvent]:
        if self._final_returned or self._parts is not None:
            raise StopAsyncIteration
        while not self._events:
            await self.wait()
        return self.take_events()

    def wait(self) -> asyncio.Future[None]:
        """A future that resolves once an event is waiting (pull mode without a coroutine:
        ``wait().add_done_callback(...)``, then :meth:`take_events`). One waiter at a time."""
        w = self._waiter = self._conn.loop.create_future()
        if self._events:
            w.set_result(None)
        w.add_done_callback(self._waited)
        return w

    def _waited(self, w: asyncio.Future[None]) -> None:
        if self._waiter is w:
            self._waiter = None

    def take_events(self) -> list[StreamEvent]:
        """Every event waiting now (possibly none), granting credit for their tokens."""
        events, self._events = self._events, []
        ntok = 0
        for ev in events:
            if type(ev) is TokenEntry:
                ntok += len(ev.token_ids)
        if ntok:
            self._unacked += ntok
            if self._unacked >= self._conn.grant_batch:
                self._grant()
        if self.done and not self._events:
            self._final_returned = True
        return events

    def deliver(self, entry: TokenEntry) -> None:
        """One entry, in whatever mode the stream is in (the per-entry path of :func:`deliver_tokens`)."""
        if self._parts is not None or self._listener is not None:
            _text_entry(self, entry.text, len(entry.token_ids), self._conn.grant_batch)
        else:
            self._push(entry)

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
        if self._events:  # usually none: collect() is called right after the submit
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
            self.done = False  # let _end resolve the future with what was buffered
            self._end(final)
        elif self._unacked >= self._conn.grant_batch:
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
        if self._unacked >= self._conn.grant_batch or (self._unacked and self._final_returned):
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
        self._conn.cancel_request(self.request_id)

    def received(self) -> Received | None:
        """After an error end: the tokens this stream received and the bytes of their text (kept at
        its end, or read from its dead connection's log); None before, or when its history is gone."""
        got = self._received
        if got is None and self.done:
            got = self._received = self._conn.received(self.request_id, self.mark)
        return got


def _text_entry(st: ClientStream, text: bytes, n: int, grant: int) -> None:
    """One entry for a collecting or listening stream (the logprob-batch path of deliver_tokens)."""
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
    if st._unacked >= grant:
        st._grant()


def deliver_tokens(streams: dict[int, ClientStream], batch: TokenBatch, grant: int) -> None:
    """Hand one engine step's tokens to their streams, walking the packed arrays.

    Collecting streams get their text slice appended (no per-entry object);
    the others get a :class:`TokenEntry`. Batches with logprobs take the
    general path (:meth:`TokenBatch.entries`).
    """
    if batch.has_logprobs or batch.top_ns:
        for entry in batch.entries():
            st = streams.get(entry.request_id)
            if st is not None:
                st.deliver(entry)
        return
    text = batch.text
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
