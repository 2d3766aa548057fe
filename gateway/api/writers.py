"""Response writers: one per wire format, fed by the generation call.

A writer turns a generation's events into the bytes of its wire format and
nothing else: it never writes to a sink, never sees a deadline or a retry
(that is :class:`~gateway.api.call.GenerationCall`'s job). Two for the OpenAI
API today: :class:`JsonWriter` (one whole ``chat.completion`` /
``text_completion`` body) and :class:`SseWriter` (``chat.completion.chunk`` /
``text_completion`` events). gRPC and gRPC-Web writers sit beside them with the
same shape.

Adding a writer: a class with the :class:`Writer` methods in a module of its own,
and the route (or content type) that picks it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import orjson

from transport.messages import Finish, FinishReason, TokenEntry

from ..errors import APIError, Headers, render_http, render_sse
from .params import GenerationRequest
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
)
from .tools import ToolCallParser

__all__ = ["Writer", "JsonWriter", "SseWriter", "ToolJsonWriter", "ToolSseWriter", "writer_for", "choice_writer"]

_dumps = orjson.dumps


class Writer(Protocol):
    streaming: bool  # True: start + chunks + end; False: one whole response at the finish
    headers: Headers  # of a successful response
    trailers: Headers | None  # a stream ends with these, read once it has ended (None: none)

    def opening(self) -> bytes:
        """A stream's first bytes, sent with its head (b"" if none)."""
        ...

    def text(self, delta: bytes) -> bytes:
        """One engine step's text, no logprobs (the hot path): a stream's chunk; b"" for a
        whole response, which keeps it."""
        ...

    def entries(self, events: list[TokenEntry]) -> bytes:
        """Token entries with whatever they carry (logprobs); bytes to send now (streams)."""
        ...

    def finish(self, fin: Finish) -> bytes:
        """The end: a stream's last chunks, or the whole response's body."""
        ...

    def error(self, err: APIError) -> tuple[int, Headers, bytes]:
        """An error before anything was sent: a whole response."""
        ...

    def stream_error(self, err: APIError) -> bytes:
        """An error once a stream has started: its terminal event."""
        ...


class _OpenAIWriter:
    """What both OpenAI writers share (each sets these slots itself: no super() call per request)."""

    __slots__ = ("g", "_lps", "_offset")

    trailers: Headers | None = None  # HTTP responses end with none
    g: GenerationRequest
    _lps: Any  # logprobs of what is being written (chat: list; legacy: dict of lists)
    _offset: int  # legacy completions' text_offset

    def _logprobs(self, ev: TokenEntry) -> None:
        g = self.g
        if g.chat:
            self._lps = (self._lps or []) + chat_logprobs(ev, g.top_logprobs)
        else:
            if self._lps is None:
                self._lps = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            self._offset = completion_logprobs(ev, g.top_logprobs, self._lps, self._offset)

    def error(self, err: APIError) -> tuple[int, Headers, bytes]:
        return render_http(err)

    def stream_error(self, err: APIError) -> bytes:
        return render_sse(err)


class JsonWriter(_OpenAIWriter):
    """A whole OpenAI response, built at the finish."""

    __slots__ = ("_parts",)
    streaming = False
    headers = JSON_HEADERS

    def __init__(self, g: GenerationRequest) -> None:
        self.g = g
        self._lps = None
        self._offset = 0
        self._parts: list[bytes] = []

    def opening(self) -> bytes:
        return b""

    def text(self, delta: bytes) -> bytes:
        self._parts.append(delta)
        return b""

    def entries(self, events: list[TokenEntry]) -> bytes:
        for ev in events:
            self._parts.append(ev.text)
            if self.g.logprobs:
                self._logprobs(ev)
        return b""

    def finish(self, fin: Finish) -> bytes:
        parts = self._parts
        return self.whole(parts[0] if len(parts) == 1 else b"".join(parts), fin)

    def whole(self, text: bytes, fin: Finish) -> bytes:
        """The body from the whole text (kept here, or collected by the transport)."""
        g = self.g
        lps = None
        if g.logprobs:
            lps = {"content": self._lps or []} if g.chat else (
                self._lps or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
        return response_body(g.chat, g.model, text.decode("utf-8", "replace"), fin, lps)


class SseWriter(_OpenAIWriter):
    """Server-sent events, one chunk per engine step."""

    __slots__ = ("_tpl",)
    streaming = True
    headers = SSE_HEADERS

    def __init__(self, g: GenerationRequest, index: int = 0, rid: str = "", created: int = 0) -> None:
        """``index``, ``rid``, ``created``: one choice of several (gateway.api.fanout), which share the
        response's id and time."""
        self.g = g
        self._lps = None
        self._offset = 0
        self._tpl = ChunkTemplate(g.chat, rid or new_id("chatcmpl" if g.chat else "cmpl"), g.model, g.include_usage,
                                  index, created)

    def opening(self) -> bytes:
        return self._tpl.role() if self.g.chat else b""

    def text(self, delta: bytes) -> bytes:
        tpl = self._tpl
        return tpl.head + _dumps(delta.decode("utf-8", "replace")) + tpl.tail

    def entries(self, events: list[TokenEntry]) -> bytes:
        if not events:
            return b""
        raw = events[0].text if len(events) == 1 else b"".join(ev.text for ev in events)
        text = bytes(raw).decode("utf-8", "replace")
        if not self.g.logprobs:
            return self._tpl.content(text)
        self._lps = None
        for ev in events:
            self._logprobs(ev)
        return self._tpl.content_with_logprobs(text, self._lps)

    def finish(self, fin: Finish) -> bytes:
        tpl = self._tpl
        out = tpl.finish(finish_reason(fin))
        if self.g.include_usage:
            out += tpl.usage(fin)
        return out + DONE


class ToolJsonWriter(JsonWriter):
    """A whole chat response whose text may hold tool calls (:mod:`gateway.api.tools`): they go in the
    message's ``tool_calls``, the text around them is its content; ``finish_reason`` ``tool_calls``
    when the answer ended by itself with calls."""

    __slots__ = ()

    def whole(self, text: bytes, fin: Finish) -> bytes:
        g = self.g
        parser = ToolCallParser()
        parser.feed(text.decode("utf-8", "replace"), final=True)
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parser.calls]
        lps = {"content": self._lps or []} if g.logprobs else None
        return response_body(True, g.model, "".join(parser.content), fin, lps, calls)


class ToolSseWriter(SseWriter):
    """A streamed chat whose text may hold tool calls, streamed as OpenAI streams them: a chunk opening
    each call (``index``, ``id``, ``type``, ``function.name``, empty ``arguments``), then chunks of
    ``function.arguments`` as the model writes them."""

    __slots__ = ("_parser",)

    def __init__(self, g: GenerationRequest, index: int = 0, rid: str = "", created: int = 0) -> None:
        super().__init__(g, index, rid, created)
        self._parser = ToolCallParser()

    def _chunks(self, events: list[tuple[Any, ...]]) -> bytes:
        tpl = self._tpl
        out = b""
        for ev in events:
            if ev[0] == "content":
                out += tpl.content(ev[1])
            elif ev[0] == "call":
                _, index, cid, name = ev
                out += tpl.delta({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                                  "function": {"name": name, "arguments": ""}}]})
            else:
                out += tpl.delta({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    def text(self, delta: bytes) -> bytes:
        return self._chunks(self._parser.feed(delta.decode("utf-8", "replace")))

    def entries(self, events: list[TokenEntry]) -> bytes:
        return self.text(b"".join(bytes(ev.text) for ev in events))  # (a tool answer's logprobs: not streamed)

    def finish(self, fin: Finish) -> bytes:
        tpl = self._tpl
        out = self._chunks(self._parser.feed("", final=True))
        reason = "tool_calls" if self._parser.calls and fin.reason == FinishReason.STOP else finish_reason(fin)
        out += tpl.finish(reason)
        if self.g.include_usage:
            out += tpl.usage(fin)
        return out + DONE


def writer_for(g: GenerationRequest) -> JsonWriter | SseWriter:
    if g.tools is not None:  # a chat with tools whose calls are read back (tool_choice other than none)
        return ToolSseWriter(g) if g.stream else ToolJsonWriter(g)
    return SseWriter(g) if g.stream else JsonWriter(g)


def choice_writer(g: GenerationRequest, index: int, rid: str, created: int,
                  usage_null: bool = False) -> JsonWriter | SseWriter:
    """:func:`writer_for` one choice of several (gateway.api.fanout): streams name ``index`` and share
    ``rid`` and ``created``; a whole response's choices are merged from their bodies. ``usage_null``:
    its chunks say ``"usage": null`` (the request's include_usage), its finish brings no usage chunk
    (the fan writes the request's)."""
    if not g.stream:
        return writer_for(g)
    u = replace(g, include_usage=True) if usage_null else g
    w = ToolSseWriter(u, index, rid, created) if g.tools is not None else SseWriter(u, index, rid, created)
    w.g = g
    return w

