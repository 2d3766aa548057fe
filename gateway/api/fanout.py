"""One request of several sequences: ``n`` > 1, ``best_of``, batched prompts (``/v1/completions``).

How it works: :class:`FanOut` runs the request as sub-generations, each an ordinary
:class:`~gateway.api.call.GenerationCall` (deadline, retry, failover, slow clients: all as for one
sequence) with a writer of its own choice (``index`` = prompt index x n + j, OpenAI's order) and a
sink of the fan's (:class:`_SubSink`), and merges them into one response on the client's sink:

* a stream: every sub-call's chunks go straight through, interleaved as the engine steps come, each
  naming its choice's ``index`` (the SDK reassembles by index); the first sub-call to open the
  stream sends the head; each sub-call's finish chunk carries its own ``finish_reason``; the fan
  writes the usage chunk (``stream_options.include_usage``) and the one ``[DONE]`` when the last one
  finished;
* a whole response: each sub-call's body is kept; at the last finish they become one body, its
  ``choices`` in index order (``best_of``: the ``n`` with the highest cumulative logprob per prompt,
  each sequence generated with logprobs; they are dropped from the answer unless asked for).

Usage counts every sequence: a prompt's tokens once per prompt, the completion tokens of every
sequence (``best_of``'s discarded ones too, as OpenAI bills them); ``cached_tokens`` of a prompt is
its least cached sub-generation's.

All sub-generations go to ONE replica (the first is routed as any request, the others pinned to its
connection by :class:`_Pinned`; a retry of one that the pinned replica refuses goes where the
policy says), so the worker's engine prefills their shared prompt once and the others take its KV
blocks from the prefix cache (``inference.engine.Engine._follows``). Seeds: with a request ``seed``
sequence j of a prompt gets :func:`sub_seed` (j = 0: the seed itself, so choice 0 is what ``n`` = 1
gives), deterministic; without one each gets the worker's random seed.

Errors and ends: the first sub-call to fail ends the request with its error, once (a whole error
response before anything was sent, an SSE error event after) and cancels the others; the client
going away cancels all. The request's end hook (metrics, admission release) runs once, when the
last sub-call has ended. The pipeline's plain ``n`` = 1 path never comes here
(``GenerationRequest.fan``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import orjson

from transport.api import WorkerConnection
from transport.messages import Finish, TokenEntry

from .. import clock
from ..errors import APIError, Headers, internal_error, render_http, render_sse
from ..http.types import ResponseSink
from ..routing.errors import RoutingError
from ..routing.pool import ModelPool
from ..routing.routed import RoutedStream, SubmitFactory
from .call import WHOLE, CallContext, GenerationCall
from .fan_merge import merged_body, sub_seed, usage
from .params import GenerationRequest
from .render import DONE, JSON_HEADERS, SSE_HEADERS, ChunkTemplate, new_id
from .writers import Writer, choice_writer, writer_for

__all__ = ["FanOut"]

log = logging.getLogger("quicserve.api")

class _Pinned:
    """The pool as a pinned sub-generation's :class:`RoutedStream` sees it: its replica first."""

    __slots__ = ("_pool", "_conn", "retries", "on_retry", "budget", "active", "unstarted")

    def __init__(self, pool: ModelPool, conn: WorkerConnection) -> None:
        self._pool = pool
        self._conn = conn
        self.retries = pool.retries
        self.on_retry = pool.on_retry
        self.budget = pool.budget
        self.active = pool.active
        self.unstarted = pool.unstarted

    def choose(self, model: str, subject: object, exclude: tuple[WorkerConnection, ...],
               make_submit: SubmitFactory | None) -> WorkerConnection | None:
        c = self._conn
        if c not in exclude and not c.closed and not c.draining:
            return c
        return self._pool.choose(model, subject, exclude, make_submit)

    def failed(self, conn: WorkerConnection | None, model: str) -> None:
        self._pool.failed(conn, model)


class _SubWriter:
    """A sub-call's writer: its choice's writer, its finish and errors reported to the fan. Always
    ``streaming`` (the sub-call reads its stream step by step, push or pull; a whole response's
    choice writer keeps the text and renders its body at the finish)."""

    __slots__ = ("_fan", "_i", "_w")
    streaming = True
    headers: Headers = []
    trailers: Headers | None = None

    def __init__(self, fan: FanOut, i: int, w: Writer) -> None:
        self._fan = fan
        self._i = i
        self._w = w

    def opening(self) -> bytes:
        return self._w.opening()

    def text(self, delta: bytes) -> bytes:
        return self._w.text(delta)

    def entries(self, events: list[TokenEntry]) -> bytes:
        return self._w.entries(events)

    def finish(self, fin: Finish) -> bytes:
        return self._fan._finished(self._i, fin, self._w.finish(fin))

    def error(self, err: APIError) -> tuple[int, Headers, bytes]:
        self._fan._failed(err)
        return err.status, [], b""

    def stream_error(self, err: APIError) -> bytes:
        self._fan._failed(err)
        return b""


class _SubSink:
    """A sub-call's sink: a stream's chunks go to the client's sink (the first start sends its head);
    a whole response's, nowhere (the fan writes the merged body). Nothing passes once the fan ended."""

    __slots__ = ("_fan",)

    def __init__(self, fan: FanOut) -> None:
        self._fan = fan

    def respond(self, status: int, headers: Headers, body: bytes) -> None:
        pass  # a sub-call's error: the fan has it from the writer

    def start(self, status: int, headers: Headers) -> None:
        fan = self._fan
        if fan.stream and not fan._opened and not fan._over:
            fan._opened = True
            fan._sink.start(200, fan._headers)

    def send_nowait(self, data: bytes) -> bool:
        fan = self._fan
        if not data or not fan.stream or fan._over:
            return True
        return fan._sink.send_nowait(data)

    async def send(self, data: bytes) -> None:
        fan = self._fan
        if not data or not fan.stream or fan._over:
            return
        if fan._lock is None:
            fan._lock = asyncio.Lock()
        async with fan._lock:  # one writer at a time on the client's sink
            await fan._sink.send(data)

    def end(self, trailers: Headers | None = None) -> None:
        pass  # the fan ends the client's response once every sequence has

    def abort(self) -> None:
        """A sub-call cuts the response (its client read nothing in time, or the deadline or a
        shutdown found it not reading); its end, which comes at once, says why (_sub_ended)."""
        fan = self._fan
        if not fan._over:
            fan._over = True
            fan._status = -1
            fan._sink.abort()


EndHook = Callable[[Any, int, int], None]


class FanOut:
    """One request of several sequences (the :class:`~gateway.http.types.Call` the pipeline hands back).

    Built by the pipeline (``Generations.start``) in place of opening one routed stream: the
    constructor opens every sub-generation's stream (a :class:`RoutingError` closes those opened and
    propagates: the request is refused as any other), :meth:`call` binds the response side."""

    mode = WHOLE  # for the end hook: no time per output token across several sequences

    def __init__(self, pool: ModelPool, g: GenerationRequest, make_writer: Callable[[GenerationRequest], Writer]) -> None:
        if make_writer is not writer_for:
            raise APIError(400, "n > 1, best_of and batched prompts are served on the OpenAI routes only.",
                           "invalid_request_error", "n", "unsupported_parameter")
        self.g = g
        self.stream = g.stream
        self._rid = new_id("chatcmpl" if g.chat else "cmpl")
        self._per = 0  # sequences per prompt (_plan)
        self._subs = self._plan(g)
        self._routed: list[RoutedStream] = []
        try:
            first = pool.open(g.model, self._subs[0].make_submit, self._subs[0])
            self._routed.append(first)
            pinned = _Pinned(pool, first.conn) if first.conn is not None else pool
            for sub in self._subs[1:]:
                r = RoutedStream(pinned, g.model, sub, sub.make_submit)
                r.submit()
                self._routed.append(r)
        except RoutingError:
            for r in self._routed:
                r.close()
            raise
        self.routed = first  # its replica is the request's, for the pool's health (the end hook)
        self._over = False  # the response ended (finished, failed, cancelled): nothing more passes
        self._opened = False  # a stream's head was sent
        self._lock: asyncio.Lock | None = None
        self.t_first = 0.0

    def _plan(self, g: GenerationRequest) -> list[GenerationRequest]:
        """The sub-generations, in choice order: every prompt's ``per`` sequences."""
        f = g.fan
        assert f is not None
        per = self._per = f.best_of or f.n
        prompts = f.batch if f.batch is not None else ((g.prompt, g.prompt_token_ids),)
        seed = g.params.seed
        params = replace(g.params, max_tokens=g.params.max_tokens // (len(prompts) * per))  # (params._fan)
        logprobs, top = g.logprobs, g.top_logprobs
        if f.best_of:  # ranked by cumulative logprob: every sequence brings its logprobs
            params = replace(params, logprobs=True)
            logprobs = True
        subs = []
        for text, ids in prompts:
            for j in range(per):
                p = params if seed is None else replace(params, seed=sub_seed(seed, j))
                subs.append(replace(g, params=p, prompt=text, prompt_token_ids=ids, include_usage=False,
                                    logprobs=logprobs, top_logprobs=top, fan=None, prompt_tokens=-1))
        return subs

    # -- the response side ---------------------------------------------------------------------
    def call(self, ctx: CallContext, sink: ResponseSink, route: str, t0: float, on_end: EndHook,
             done: Callable[[], None], timeout: float | None, headers: Sequence[tuple[bytes, bytes]] | None,
             ticket: Any) -> FanOut:
        self._sink = sink
        self._write_timeout = ctx.write_timeout
        self.route = route
        self.t0 = t0
        self.ticket = ticket
        self._on_end = on_end
        self._done = done
        base = SSE_HEADERS if self.stream else JSON_HEADERS
        self._headers = base if not headers else [*base, *headers]
        self._error: APIError | None = None
        self._fins: list[Finish | None] = [None] * len(self._subs)
        self._bodies: list[bytes] = [b""] * len(self._subs)
        self._ended = 0  # sub-calls ended
        self._next = 0  # the next sub-call to start (those after it have not)
        self._starting = False
        self._status = 200
        self._closed = False  # _finish_request ran
        created = int(clock.wall())
        sub_sink = _SubSink(self)
        self._calls: list[GenerationCall] = []
        for i, (sub, routed) in enumerate(zip(self._subs, self._routed, strict=True)):
            w = choice_writer(sub, i, self._rid, created, self.g.include_usage)
            self._calls.append(GenerationCall(ctx, routed, _SubWriter(self, i, w), sub_sink, route, t0, sub.logprobs,
                                              self._sub_ended, _ignore, timeout, None, i))
        return self

    def start(self) -> None:
        self._starting = True
        try:
            calls = self._calls
            while self._next < len(calls):  # (a failure while starting them ends the rest: _cancel_subs)
                c = calls[self._next]
                self._next += 1
                c.start()
        finally:
            self._starting = False
        if self._ended == len(self._calls):
            self._finish_request()

    def cancel(self) -> bool:
        """The client went away: every sequence stops; nothing more is written."""
        if self._over:
            return False
        self._over = True
        self._status = 499
        self._cancel_subs()
        return True

    def _cancel_subs(self) -> None:
        """End every sub-call: the started ones cancelled (each ends, 499, and reports), the others
        never start (their worker requests cancelled here)."""
        started = self._next
        self._next = len(self._calls)
        for r in self._routed[started:]:
            r.close()
        self._ended += len(self._calls) - started
        for c in self._calls[:started]:
            c.cancel()

    # -- the sub-calls' reports ----------------------------------------------------------------
    def _finished(self, i: int, fin: Finish, last: bytes) -> bytes:
        """Sub-call ``i`` finished: its finish chunk goes on (a stream; the fan writes [DONE]), a
        whole response's body is kept."""
        self._fins[i] = fin
        if not self.stream:
            self._bodies[i] = last
            return b""
        return last[: -len(DONE)] if last.endswith(DONE) else last

    def _failed(self, err: APIError) -> None:
        if self._error is None and not self._over:
            self._error = err

    def _sub_ended(self, call: GenerationCall, status: int, tokens: int) -> None:
        self._ended += 1
        if call.t_first and (not self.t_first or call.t_first < self.t_first):
            self.t_first = call.t_first
        if status != 200 and not self._over:  # the first failure: the request's one error, then the rest stop
            self._over = True
            err = self._error or APIError(status, "A sequence of this request failed.", "server_error")
            self._status = err.status
            if self._opened:
                self._write_last(render_sse(err))
            else:
                self._sink.respond(*render_http(err))
            self._cancel_subs()  # (each reports here again; the last one may end the request)
        elif status != 200 and self._status < 0:  # the sub-call that cut the response (_SubSink.abort)
            self._status = status
            self._cancel_subs()
        if self._ended == len(self._calls) and not self._starting:
            self._finish_request()

    def _finish_request(self) -> None:
        """Every sub-call ended: the merged answer if all finished, then the request's one end."""
        if self._closed:
            return
        self._closed = True
        if not self._over:
            self._over = True
            self._status = 200
            try:
                if self.stream:
                    g = self.g
                    out = b""
                    if g.include_usage:
                        out = ChunkTemplate(g.chat, self._rid, g.model, True).usage(usage(self._fins, self._per))
                    if not self._opened:  # (no sequence sent a token)
                        self._opened = True
                        self._sink.start(200, self._headers)
                    self._write_last(out + DONE)
                else:
                    self._sink.respond(200, self._headers, self._merged())
            except Exception:
                log.exception("merging the choices of %s failed", self.route)
                self._status = 500
                if self._opened:
                    self._sink.abort()
                else:
                    self._sink.respond(*render_http(internal_error()))
        if self._tail is None:
            self._end()

    _tail: asyncio.Task[None] | None = None

    def _write_last(self, data: bytes) -> None:
        sink = self._sink
        if sink.send_nowait(data):
            sink.end()
            return

        async def last() -> None:
            try:
                await asyncio.wait_for(sink.send(data), self._write_timeout)
                sink.end()
            except (TimeoutError, ConnectionError):
                sink.abort()
                self._status = 408
            except asyncio.CancelledError:
                pass
            self._tail = None
            if self._closed:  # every sequence ended: _finish_request left the end to this
                self._end()

        self._tail = asyncio.ensure_future(last())

    def _end(self) -> None:
        if self._status < 0:
            self._status = 499
        tokens = sum(f.completion_tokens for f in self._fins if f is not None) if self._status == 200 else 0
        try:
            self._on_end(self, self._status, tokens)
        finally:
            asyncio.get_running_loop().call_soon(self._done)

    def _merged(self) -> bytes:
        f = self.g.fan
        assert f is not None
        return merged_body([orjson.loads(b) for b in self._bodies], self._rid, self._fins, self._per,
                           f.n if f.best_of else 0, self.g.logprobs)


def _ignore() -> None:
    """A sub-call's done: the fan's own comes once, at the request's end."""
