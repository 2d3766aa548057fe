"""The generation call: one request from its submit to its one end, driven by callbacks.

How it works: the call owns the routed stream, the deadline, cancellation, the
retry (before the first token: start over elsewhere; after it: resume elsewhere from
what the client has, :mod:`~gateway.routing.routed`), token metrics and the end. It reads the stream in
the cheapest mode the response allows, each a callback from the transport, so
no task runs per request and nothing wakes per token unless it must:

* **whole** (non-streaming, no logprobs): the transport buffers the text
  (``stream.collect()``) and the call wakes once, at the end;
* **push** (streaming, no logprobs): ``stream.listen(on_text)`` hands each engine
  step's text to :meth:`_on_text`, which writes the chunk at once;
* **pull** (logprobs): ``stream.wait()`` / ``take_events()`` per engine step.

A :class:`~gateway.api.writers.Writer` turns events into the wire format. The
only coroutine is :meth:`_resume`, and only while a client is not reading: the
call awaits ``sink.send`` for the chunk it could not write, then goes on where
it was. The call ends exactly once (:meth:`_end`): a finished response, an error
(a whole error response before anything was sent, the writer's terminal event
after), a 504 at the deadline, or 499 when the client went away (nothing sent).
Then ``on_end(call, status, completion_tokens)`` runs (metrics, admission release, span, access
log: the owner reads what it needs from the call, its own ``ticket`` included, so nothing is built
per request for it), then ``done()`` (the adapter's next request), never inside :meth:`start`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from transport.messages import Finish, TokenEntry

from .. import clock
from ..errors import APIError, from_wire_code, internal_error
from ..http.types import ResponseSink
from ..routing.routed import RoutedStream
from .writers import JsonWriter, Writer

if TYPE_CHECKING:
    from .deadlines import DeadlineSweeper

__all__ = ["GenerationCall", "CallContext", "WHOLE", "PUSH", "PULL"]

log = logging.getLogger("quicserve.api")
_perf = clock.now  # the request clock (gateway/clock.py): t0, admission's now, latencies
# transport/ stamps first_token_at with time.perf_counter; the request clock is that clock shifted by
# clock.OFFSET (0 outside tests): the conversion is exact and costs an addition
_FROM_TRANSPORT = clock.OFFSET

EndHook = Callable[["GenerationCall", int, int], None]
"""(the call, status, completion tokens): its owner reads ``route``, ``t0``, ``t_first`` (perf_counter
time of the first token, or 0.0), ``mode`` (WHOLE: the tokens came at once, no time per token) and its
own ``ticket`` from the call; a status of 200 is a finished generation, every other an error."""

WHOLE, PUSH, PULL = 0, 1, 2  # how the call reads its stream (module docstring); its ``mode``


class CallContext:
    """What every call of one app shares: the deadline sweeper, the timeouts."""

    __slots__ = ("deadlines", "timeout", "write_timeout")

    def __init__(self, deadlines: DeadlineSweeper, timeout: float, write_timeout: float = 60.0) -> None:
        self.deadlines = deadlines
        self.timeout = timeout
        self.write_timeout = write_timeout  # a client that reads nothing this long is cut off

    def timeout_error(self, timeout: float) -> APIError:
        return APIError(504, f"The request did not finish within {timeout:g} s.", "server_error", None,
                        "timeout")


class GenerationCall:
    """One generation request (the :class:`~gateway.http.types.Call` the pipeline hands back)."""

    __slots__ = ("_ctx", "_routed", "routed", "_w", "_sink", "route", "t0", "t_first", "ticket", "_on_end", "_done",
                 "_started", "_ended", "_starting", "_held", "_held_final", "_resumer", "mode", "_fut", "_timeout",
                 "_text", "_send_nowait", "_headers")
    # set where they are first needed (see __init__)
    _starting: bool  # inside start(): done() is deferred to the next loop iteration
    _fut: asyncio.Future[Any]  # what the call waits on now; others are stale
    _held: bytes | None  # a chunk the client was not ready for
    _held_final: object  # pull mode: the final event that came with it
    _text: Callable[[bytes], bytes]  # push mode: the writer's text, bound once (per engine step)
    _send_nowait: Callable[[bytes], bool]  # push mode: the sink's

    def __init__(self, ctx: CallContext, routed: RoutedStream, writer: Writer, sink: ResponseSink, route: str,
                 t0: float, logprobs: bool, on_end: EndHook, done: Callable[[], None],
                 timeout: float | None = None, headers: Sequence[tuple[bytes, bytes]] | None = None,
                 ticket: Any = None) -> None:
        # Only what every call reads is set here (this runs once per request); the rest is set where
        # its mode or path needs it: _starting (start), _fut (_read), _held/_held_final (a slow
        # client), _text/_send_nowait (push mode).
        self._ctx = ctx
        self._routed = self.routed = routed  # public: the pipeline reads the replica it ended on
        self._w = writer
        self._sink = sink
        self.route = route
        self.t0 = t0
        self.t_first = 0.0  # perf_counter time of the first token
        self.ticket = ticket  # the owner's, for its end hook (opaque here)
        self._on_end = on_end
        self._done = done
        self._started = False  # response head sent (streams)
        self._ended = False
        self._resumer: asyncio.Task[None] | None = None  # the coroutine of a client that is not reading
        self.mode = PULL if logprobs else PUSH if writer.streaming else WHOLE
        self._timeout = ctx.timeout if timeout is None else min(timeout, ctx.timeout)
        self._headers = writer.headers if not headers else [*writer.headers, *headers]  # + x-ratelimit-*

    # -- start and read -------------------------------------------------------------------
    def start(self) -> None:
        self._starting = True
        try:
            self._ctx.deadlines.add(self, self._timeout)
            self._routed.on_moved = self._read  # a rebalance moved the request before its first token
            self._read()
        except Exception:
            self._crash()
        finally:
            self._starting = False

    def _read(self) -> None:
        """Read the current stream (again, after a retry) in this call's mode."""
        stream = self._routed.stream
        assert stream is not None
        mode = self.mode
        if mode == WHOLE:
            fut: asyncio.Future[Any] = stream.collect()
        elif mode == PULL:
            self._pull_events()
            return
        else:
            self._text = self._w.text  # bound once: both run once per engine step
            self._send_nowait = self._sink.send_nowait
            fut = stream.listen(self._on_text)
        self._fut = fut  # what the call waits on now; others are stale
        fut.add_done_callback(self._collected if mode == WHOLE else self._listened)

    def _collected(self, fut: asyncio.Future[Any]) -> None:
        if self._ended or fut is not self._fut or fut.cancelled():
            return
        try:
            res = fut.result()
            fin = res.final
            if type(fin) is not Finish and self._routed.retry(fin):  # nothing was sent: start over elsewhere
                self._read()
                return
            # the end, at once: nothing can move or retry it before _end closes the routed stream
            t = res.first_token_at  # delivered whole: when the transport saw it, on the request clock
            self.t_first = t + _FROM_TRANSPORT if t else 0.0
            if type(fin) is not Finish:
                self._fail(from_wire_code(fin.code, fin.message))
                return
            n = fin.completion_tokens
            w = self._w
            assert isinstance(w, JsonWriter)
            self._sink.respond(200, self._headers, w.whole(res.text, fin))
            self._end(200, n)
        except Exception:
            self._crash()

    # push mode
    def _on_text(self, delta: bytes) -> bool:
        """One engine step's text, from the transport's receive path. False: the client is not
        reading (the chunk is held; the listen future resolves to None)."""
        if not self._started:
            self._open()
        chunk = self._text(delta)
        if self._send_nowait(chunk):
            return True
        self._held = chunk
        return False

    def _listened(self, fut: asyncio.Future[Any]) -> None:
        if self._ended or fut is not self._fut or fut.cancelled():
            return
        try:
            ev = fut.result()
            if ev is None:  # the client is slow (_on_text held its chunk): wait for it, then listen again
                self._wait_for_client(None)
            else:
                self._final(ev)
        except Exception:
            self._crash()

    # pull mode
    def _pull_events(self) -> None:
        stream = self._routed.stream
        assert stream is not None
        while not self._ended:
            events = stream.take_events()
            if not events:
                self._fut = w = stream.wait()
                w.add_done_callback(self._pulled)
                return
            last = events[-1]
            final = last if type(last) is not TokenEntry else None
            entries: list[TokenEntry] = events[:-1] if final is not None else events  # type: ignore[assignment]
            if entries:
                if not self._started:
                    self._open()
                chunk = self._w.entries(entries)
                if chunk and not self._sink.send_nowait(chunk):
                    self._held = chunk
                    self._wait_for_client(final)
                    return
            if final is not None:
                self._final(final)
                return

    def _pulled(self, fut: asyncio.Future[Any]) -> None:
        if self._ended or fut is not self._fut or fut.cancelled():
            return
        try:
            self._pull_events()
        except Exception:
            self._crash()

    # -- writing ----------------------------------------------------------------------------
    def _open(self) -> None:
        """The first token: the request can no longer move; a stream sends its head."""
        self._routed.start()
        self.t_first = _perf()
        w = self._w
        if w.streaming:
            self._started = True
            self._sink.start(200, self._headers)
            first = w.opening()
            if first:
                self._sink.send_nowait(first)  # False only if the client is already gone

    def _wait_for_client(self, final: object) -> None:
        """Send the held chunk once the client can take it, then ``final`` (pull mode: the final
        event that came with it) or read on."""
        self._held_final = final
        self._resumer = asyncio.ensure_future(self._resume())

    async def _resume(self) -> None:
        chunk, self._held = self._held, None
        try:
            if chunk:
                await asyncio.wait_for(self._sink.send(chunk), self._ctx.write_timeout)
        except TimeoutError:  # the client reads nothing: it cannot take an error event either
            self._resumer = None
            log.info("%s: the client read nothing for %g s; cutting the stream", self.route, self._ctx.write_timeout)
            self._sink.abort()
            self._end(408, 0)
            return
        except (ConnectionError, asyncio.CancelledError):
            return  # the adapter cancels the call
        self._resumer = None
        if self._ended:
            return
        try:
            final, self._held_final = self._held_final, None
            if final is not None:
                self._final(final)
            elif self.mode == PULL:
                self._pull_events()
            else:
                self._read()
        except Exception:
            self._crash()

    def _final(self, ev: object) -> None:
        if type(ev) is Finish:
            if not self._started and not self.t_first:
                self._open()  # a finish with no token
            n = ev.completion_tokens
            w = self._w
            body = w.finish(ev)
            if w.streaming:
                self._write_last(body, 200, n)
            else:
                self._sink.respond(200, self._headers, body)
                self._end(200, n)
        elif self._routed.retry(ev):  # its replica was lost: on another (after the first token: resumed)
            self._read()
        else:
            self._fail(from_wire_code(ev.code, ev.message))  # type: ignore[attr-defined]

    def _write_last(self, data: bytes, status: int, tokens: int) -> None:
        """A stream's last bytes, then its end (with the writer's trailers, if it has any: native
        gRPC's status); the call ends once they are written."""
        sink = self._sink
        if sink.send_nowait(data):
            self._end_sink()
            self._end(status, tokens)
            return

        async def last() -> None:
            try:
                await asyncio.wait_for(sink.send(data), self._ctx.write_timeout)
                self._end_sink()
            except TimeoutError:  # the client reads nothing: cut the stream, as _resume does
                self._resumer = None
                sink.abort()
                if not self._ended:
                    self._end(408, 0)
                return
            except (ConnectionError, asyncio.CancelledError):
                return  # the adapter cancels the call (499)
            self._resumer = None
            if not self._ended:
                self._end(status, tokens)

        self._resumer = asyncio.ensure_future(last())

    def _end_sink(self) -> None:
        trailers = self._w.trailers
        if trailers is None:
            self._sink.end()
        else:
            self._sink.end(trailers)

    def _fail(self, err: APIError) -> None:
        """An error: a whole error response before anything was sent, a terminal event after."""
        if self._started:
            self._write_last(self._w.stream_error(err), err.status, 0)
        else:
            self._sink.respond(*self._w.error(err))
            self._end(err.status, 0)

    def _crash(self) -> None:
        log.exception("generation call failed in %s", self.route)
        if self._ended:
            return
        try:
            self._fail(internal_error())
        except Exception:
            log.exception("could not report the failure")
            self._sink.abort()
            self._end(500, 0)

    # -- the Call contract, and the deadline sweeper's -------------------------------------------
    def cancel(self) -> bool:
        """The client went away: stop the worker request; nothing more is written."""
        if self._ended:
            return False
        self._end(499, 0)
        return True

    def expire(self) -> None:
        """The request deadline passed (:class:`~gateway.api.deadlines.DeadlineSweeper`)."""
        if self._ended:
            return
        if self._resumer is not None:  # the client is not reading: it cannot take an error event either
            self._resumer.cancel()
            self._sink.abort()
            self._end(504, 0)
            return
        self._fail(self._ctx.timeout_error(self._timeout))

    def shut_down(self, err: APIError) -> None:
        """The gateway is stopping: end now with ``err``, explicitly (an error response, or the
        stream's terminal event; a client that is not reading is cut off)."""
        if self._ended:
            return
        if self._resumer is not None:
            self._resumer.cancel()
            self._resumer = None
            self._sink.abort()
            self._end(err.status, 0)
            return
        self._fail(err)

    def _end(self, status: int, tokens: int) -> None:
        self._ended = True
        self._ctx.deadlines.discard(self)
        routed = self._routed
        routed.close()  # leaves the waiting set; a worker request still open is cancelled
        if self.mode == PUSH:
            stream = routed.stream
            if stream is not None:
                stream.unlisten()
        if self._resumer is not None:
            self._resumer.cancel()
        try:
            self._on_end(self, status, tokens)
        finally:
            if self._starting:
                asyncio.get_running_loop().call_soon(self._done)
            else:
                self._done()
