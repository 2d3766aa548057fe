"""OpenAI-compatible handlers: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Each handler returns the HTTP status it sent (for metrics) or raises
:class:`APIError` *before* anything was sent (the app renders it). Once a
stream has started, errors go out as an SSE ``data: {"error": ...}`` event.
If the client goes away the adapter cancels the handler's task; the
``finally`` cancels the worker request (a Cancel goes over the transport).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.http.types import Request, ResponseSink
from transport.client_stream import Collected
from transport.messages import Error, Finish, TokenEntry

from ..errors import APIError, from_wire_code
from ..observability.metrics import GatewayMetrics
from ..routing.pool import ModelPool, RoutedStream
from ..settings import ApiSettings
from .deadlines import DeadlineSweeper
from .params import GenerationRequest, parse_chat, parse_completion
from .render import (
    DONE,
    JSON_HEADERS,
    SSE_HEADERS,
    ChunkTemplate,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    new_id,
    response_body,
    sse_error,
)
from .unary import Respond, UnaryCall

__all__ = ["OpenAIHandlers", "CHAT_ROUTE", "COMPLETIONS_ROUTE", "MODELS_ROUTE"]

log = logging.getLogger("quicserve.api")

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"

_perf = time.perf_counter
_dumps = orjson.dumps
_PARSERS: dict[str, Callable[..., GenerationRequest]] = {CHAT_ROUTE: parse_chat, COMPLETIONS_ROUTE: parse_completion}


class OpenAIHandlers:
    """The OpenAI API over a :class:`ModelPool`."""

    def __init__(self, pool: ModelPool, metrics: GatewayMetrics, api: ApiSettings) -> None:
        self.pool = pool
        self.metrics = metrics
        self.api = api
        self.created = int(time.time())
        self._deadline_ms = int(api.request_timeout * 1000)
        self.deadlines = DeadlineSweeper()

    # -- models -------------------------------------------------------------------------
    def _model_obj(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "quicserve"}

    async def models(self, req: Request, sink: ResponseSink, t0: float) -> int:
        body = orjson.dumps({"object": "list", "data": [self._model_obj(m) for m in self.pool.models()]})
        await sink.respond(200, JSON_HEADERS, body)
        return 200

    async def model(self, req: Request, sink: ResponseSink, t0: float) -> int:
        name = req.path[len(MODELS_ROUTE) + 1:]
        if name not in self.pool.models():
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        await sink.respond(200, JSON_HEADERS, orjson.dumps(self._model_obj(name)))
        return 200

    # -- generation ---------------------------------------------------------------------
    # chat()/completions() return the generation coroutine instead of awaiting it, and
    # _unary/_stream hold their own error handling: every token wakes the handler, and
    # each coroutine frame in the await chain is resumed on every wake-up.
    def chat(self, req: Request, sink: ResponseSink, t0: float) -> Awaitable[int]:
        return self._generate(self._parse(parse_chat, req), sink, t0, CHAT_ROUTE)

    def completions(self, req: Request, sink: ResponseSink, t0: float) -> Awaitable[int]:
        return self._generate(self._parse(parse_completion, req), sink, t0, COMPLETIONS_ROUTE)

    def _parse(self, parse: Callable[..., GenerationRequest], req: Request) -> GenerationRequest:
        try:
            return parse(req.body, default_max_tokens=self.api.default_max_tokens,
                         max_tokens_limit=self.api.max_tokens_limit, deadline_ms=self._deadline_ms)
        except APIError:
            # Only now, off the success path: a compressed body fails to parse, and "not valid JSON"
            # would send its sender looking in the wrong place.
            coding = next((v for k, v in req.headers if k == b"content-encoding"), b"identity")
            if coding.strip().lower() not in (b"", b"identity"):
                raise APIError(415, f"Content-Encoding {coding.decode('latin-1')!r} is not supported; send the "
                               "request body uncompressed.", "invalid_request_error", None,
                               "unsupported_content_encoding") from None
            raise

    def parse(self, req: Request) -> GenerationRequest | None:
        """A generation route's body, parsed; None for another route or a body that does not
        parse (the task path then renders that error)."""
        parse = _PARSERS.get(req.path)
        if parse is None:
            return None
        try:
            return self._parse(parse, req)
        except APIError:
            return None

    def whole_response(self, g: GenerationRequest, route: str, res: Collected) -> bytes:
        """The body of a non-streamed response from its collected result (an Error final raises
        its APIError); counts its tokens (delivered whole: no TTFT)."""
        fin = res.final
        if type(fin) is not Finish:
            raise from_wire_code(fin.code, fin.message)  # type: ignore[union-attr]
        text = res.text.decode("utf-8", "replace")
        self.metrics.tokens(route, None, None, fin.completion_tokens)
        return response_body(g.chat, g.model, text, fin, None)

    def unary_call(self, g: GenerationRequest, route: str, respond: Respond, t0: float,
                   on_end: Callable[[int], None], done: Callable[[], None]) -> UnaryCall | None:
        """The task-free path (:mod:`.unary`) for a plain non-streaming generation, started; None
        when no worker can take it (the task path then renders that error)."""
        try:
            routed = self.pool.open(g.model, g.make_submit)
        except APIError:
            return None
        call = UnaryCall(self, g, routed, respond, t0, route, on_end, done)
        call.start()
        return call

    def generate(self, g: GenerationRequest, sink: ResponseSink, t0: float, route: str) -> Awaitable[int]:
        """A parsed generation request, served in the caller's task."""
        return self._generate(g, sink, t0, route)

    def _generate(self, g: GenerationRequest, sink: ResponseSink, t0: float, route: str) -> Awaitable[int]:
        routed = self.pool.open(g.model, g.make_submit)
        if g.stream:
            tpl = ChunkTemplate(g.chat, new_id("chatcmpl" if g.chat else "cmpl"), g.model, g.include_usage)
            return self._stream(g, tpl, routed, sink, t0, route)
        if not g.logprobs:
            return self._unary_plain(g, routed, sink, t0, route)
        return self._unary(g, routed, sink, t0, route)

    def _track(self, routed: RoutedStream) -> asyncio.Task[Any]:
        """The handler's task, under the request deadline (cancelled when it expires)."""
        task = asyncio.current_task(getattr(routed.conn, "loop", None))  # no get_running_loop (a getpid)
        assert task is not None
        self.deadlines.add(task, self.api.request_timeout)
        return task

    def _untrack(self, task: asyncio.Task[Any], routed: RoutedStream) -> None:
        """Every generation path ends here: drop the deadline, cancel the worker request if still open."""
        self.deadlines.discard(task)
        if not routed.done:
            routed.cancel()

    def _timeout(self) -> APIError:
        return APIError(504, f"The request did not finish within {self.api.request_timeout:g} s.",
                        "server_error", None, "timeout")

    @staticmethod
    async def _abort_stream(sink: ResponseSink, err: APIError) -> int:
        await sink.send(sse_error(err.status, err.message, err.type, err.code))
        await sink.end()
        return err.status

    async def _unary_plain(self, g: GenerationRequest, routed: RoutedStream, sink: ResponseSink, t0: float,
                           route: str) -> int:
        """A whole response without logprobs: the transport buffers the text, one wake-up at the end."""
        task = self._track(routed)
        try:
            res = await routed.collect()
            await sink.respond(200, JSON_HEADERS, self.whole_response(g, route, res))
            return 200
        except asyncio.CancelledError:
            if not self.deadlines.expired(task):
                raise  # the client went away
            raise self._timeout() from None
        finally:
            self._untrack(task, routed)

    async def _unary(self, g: GenerationRequest, routed: RoutedStream, sink: ResponseSink, t0: float,
                     route: str) -> int:
        task = self._track(routed)
        try:
            parts: list[bytes] = []
            lps: list[dict[str, Any]] = []
            legacy: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            offset = 0
            want_lp = g.logprobs
            events = await routed.next_events()  # may move to another worker before the first token
            t_first = _perf()
            nxt = routed.direct_next_events() if routed.started else routed.next_events
            fin: Finish | None = None
            while True:
                if len(events) == 1 and type(events[0]) is TokenEntry and not want_lp:
                    parts.append(events[0].text)  # the common case: one engine step's tokens
                else:
                    for ev in events:
                        t = type(ev)
                        if t is TokenEntry:
                            parts.append(ev.text)  # type: ignore[union-attr]
                            if want_lp:
                                if g.chat:
                                    lps.extend(chat_logprobs(ev, g.top_logprobs))  # type: ignore[arg-type]
                                else:
                                    offset = completion_logprobs(ev, g.top_logprobs, legacy, offset)  # type: ignore[arg-type]
                        elif t is Finish:
                            fin = ev  # type: ignore[assignment]
                        else:
                            err: Error = ev  # type: ignore[assignment]
                            raise from_wire_code(err.code, err.message)
                    if fin is not None:
                        break
                events = await nxt()
            text = b"".join(parts).decode("utf-8", "replace")
            assert fin is not None
            body = response_body(g.chat, g.model, text, fin, ({"content": lps} if g.chat else legacy) if want_lp else None)
            await sink.respond(200, JSON_HEADERS, body)
            self._observe(route, t0, t_first if parts else 0.0, _perf(), fin.completion_tokens)
            return 200
        except asyncio.CancelledError:
            if not self.deadlines.expired(task):
                raise  # the client went away
            raise self._timeout() from None
        finally:
            self._untrack(task, routed)

    async def _stream(self, g: GenerationRequest, tpl: ChunkTemplate, routed: RoutedStream,
                      sink: ResponseSink, t0: float, route: str) -> int:
        task = self._track(routed)
        try:
            events = await routed.next_events()  # may move to another worker before the first token
            first = events[0]
            if type(first) is Error:
                raise from_wire_code(first.code, first.message)  # nothing sent yet: a real HTTP error
            t_first = _perf() if type(first) is TokenEntry else 0.0
            tpl.started = True
            await sink.start(200, SSE_HEADERS)
            nxt = routed.direct_next_events()
            send = sink.send
            head, tail = tpl.head, tpl.tail
            pending = tpl.role() if g.chat else b""
            plain = not g.logprobs
            state = [0]  # legacy logprobs text offset
            send_nowait = getattr(sink, "send_nowait", None) if plain else None
            listen = getattr(routed.stream, "listen", None) if send_nowait is not None else None
            if listen is not None:
                if not t_first and any(type(ev) is TokenEntry for ev in events):
                    t_first = _perf()
                status = await self._stream_batch(g, tpl, events, send, sink, pending, state)
                if not status:
                    fin, status = await self._stream_pushed(g, tpl, routed, send_nowait, sink)  # type: ignore[arg-type]
                else:
                    fin = events[-1]
                if status == 200:
                    self._observe(route, t0, t_first, _perf(), fin.completion_tokens)  # type: ignore[union-attr]
                return status
            while True:
                if plain and len(events) == 1 and type(events[0]) is TokenEntry:
                    # the common case: one engine step's tokens -> one chunk, only the delta is escaped
                    await send(pending + head + _dumps(events[0].text.decode("utf-8", "replace")) + tail)
                    pending = b""
                else:
                    if not t_first and any(type(ev) is TokenEntry for ev in events):
                        t_first = _perf()
                    status = await self._stream_batch(g, tpl, events, send, sink, pending, state)
                    pending = b""
                    if status:
                        if status == 200:
                            fin = events[-1]
                            self._observe(route, t0, t_first, _perf(), fin.completion_tokens)  # type: ignore[union-attr]
                        return status
                events = await nxt()
        except asyncio.CancelledError:
            if not self.deadlines.expired(task):
                raise  # the client went away
            if not tpl.started:
                raise self._timeout() from None
            return await self._abort_stream(sink, self._timeout())
        except (APIError, ConnectionError):
            raise  # APIError: only before anything was sent; ConnectionError: the client is gone
        except Exception:
            if not tpl.started:
                raise
            log.exception("stream failed after its first byte")
            return await self._abort_stream(sink, APIError(500, "Internal server error.", "server_error"))
        finally:
            self._untrack(task, routed)

    async def _stream_pushed(self, g: GenerationRequest, tpl: ChunkTemplate, routed: RoutedStream,
                             send_nowait: Callable[[bytes], bool], sink: ResponseSink) -> tuple[Any, int]:
        """The rest of a plain stream in push mode: the transport calls ``on_text`` per engine step,
        which writes the chunk without waking this task; it wakes once at the end (or while the
        client is not reading). Returns (final event, status)."""
        stream: Any = routed.stream
        head, tail = tpl.head, tpl.tail
        held: list[bytes] = []

        def on_text(text: bytes) -> bool:
            chunk = head + _dumps(text.decode("utf-8", "replace")) + tail
            if send_nowait(chunk):
                return True
            held.append(chunk)  # the client is not reading: the task waits for it, then resumes
            return False

        try:
            while True:
                fin = await stream.listen(on_text)
                if fin is not None:
                    break
                await sink.send(held.pop())
        finally:
            stream.unlisten()
        return fin, await self._stream_batch(g, tpl, [fin], sink.send, sink, b"", [0])

    async def _stream_batch(self, g: GenerationRequest, tpl: ChunkTemplate, events: list[Any],
                            send: Any, sink: ResponseSink, pending: bytes, state: list[int]) -> int:
        """General case of one batch (several entries, logprobs, finish, error); 0 = not finished."""
        out: list[bytes] = [pending] if pending else []
        texts: list[bytes] = []
        lps: Any = None
        for ev in events:
            t = type(ev)
            if t is TokenEntry:
                texts.append(ev.text)
                if g.logprobs:
                    if g.chat:
                        lps = (lps or []) + chat_logprobs(ev, g.top_logprobs)
                    else:
                        lps = lps or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                        state[0] = completion_logprobs(ev, g.top_logprobs, lps, state[0])
            elif t is Finish:
                if texts:
                    out.append(self._content(tpl, texts, lps))
                out.append(tpl.finish(finish_reason(ev)))
                if g.include_usage:
                    out.append(tpl.usage(ev))
                out.append(DONE)
                await send(b"".join(out))
                await sink.end()
                return 200
            else:
                err = from_wire_code(ev.code, ev.message)
                if texts:
                    out.append(self._content(tpl, texts, lps))
                out.append(sse_error(err.status, err.message, err.type, err.code))
                await send(b"".join(out))
                await sink.end()
                return err.status
        if texts:
            out.append(self._content(tpl, texts, lps))
        if out:
            await send(b"".join(out))
        return 0

    @staticmethod
    def _content(tpl: ChunkTemplate, texts: list[bytes], lps: Any) -> bytes:
        raw = texts[0] if len(texts) == 1 else b"".join(texts)
        text = bytes(raw).decode("utf-8", "replace")
        if lps is None:
            return tpl.content(text)
        return tpl.content_with_logprobs(text, lps)

    def _observe(self, route: str, t0: float, t_first: float, t_end: float, n: int) -> None:
        if not t_first:
            return
        tpot = (t_end - t_first) / (n - 1) if n > 1 else None
        self.metrics.tokens(route, t_first - t0, tpot, n)
