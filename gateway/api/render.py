"""OpenAI response bodies and SSE chunks, rendered with as little work as possible.

A streamed response gets a :class:`ChunkTemplate` once per request: the bytes
before and after the text delta are pre-rendered, so each chunk costs one
``orjson.dumps`` of the delta string and a few byte concatenations.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import orjson

from transport.messages import Finish, FinishReason, TokenEntry

from .. import clock

__all__ = [
    "ChunkTemplate",
    "new_id",
    "response_body",
    "usage_dict",
    "finish_reason",
    "chat_logprobs",
    "completion_logprobs",
    "DONE",
    "JSON_HEADERS",
    "SSE_HEADERS",
]

DONE = b"data: [DONE]\n\n"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]

_PREFIX = os.urandom(5).hex()
_counter = itertools.count(1)


def new_id(kind: str) -> str:
    """Unique per process run: random prefix + counter (no per-request urandom)."""
    return f"{kind}-{_PREFIX}{next(_counter):x}"


_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


def finish_reason(fin: Finish) -> str:
    return _REASONS.get(fin.reason, "stop")


def usage_dict(fin: Finish) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def _token_repr(token_id: int) -> str:
    return f"token_id:{token_id}"


def _entry_tokens(ev: TokenEntry) -> list[str]:
    """Per-token strings: the text delta when the entry holds one token, else ids.

    Workers send one text delta per entry, not per token, so multi-token
    entries (and alternatives) are named ``token_id:<id>`` as vLLM does.
    """
    ids = ev.token_ids
    if len(ids) == 1:
        return [bytes(ev.text).decode("utf-8", "replace")]
    return [_token_repr(t) for t in ids]


def chat_logprobs(ev: TokenEntry, top_n: int) -> list[dict[str, Any]]:
    """``choices[0].logprobs.content`` items for one entry."""
    if ev.logprobs is None:
        return []
    out = []
    toks = _entry_tokens(ev)
    for i, lp in enumerate(ev.logprobs):
        tok = toks[i]
        alts = []
        if top_n and ev.top_ids is not None and ev.top_logprobs is not None:
            for j in range(i * top_n, (i + 1) * top_n):
                alt = _token_repr(ev.top_ids[j])
                alts.append({"token": alt, "logprob": float(ev.top_logprobs[j]), "bytes": list(alt.encode())})
        out.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()), "top_logprobs": alts})
    return out


def completion_logprobs(ev: TokenEntry, top_n: int, acc: dict[str, list[Any]], offset: int) -> int:
    """Append one entry to a legacy ``logprobs`` object; returns the new text offset."""
    if ev.logprobs is None:
        return offset
    toks = _entry_tokens(ev)
    for i, lp in enumerate(ev.logprobs):
        acc["tokens"].append(toks[i])
        if lp != lp:  # NaN: echo's first prompt token, which nothing predicts (transport.wire: Tasks)
            acc["token_logprobs"].append(None)
            acc["text_offset"].append(offset)
            acc["top_logprobs"].append(None)
            continue
        acc["token_logprobs"].append(float(lp))
        acc["text_offset"].append(offset)
        offset += len(toks[i]) if len(toks) == 1 else 0
        top: dict[str, float] = {}
        if top_n and ev.top_ids is not None and ev.top_logprobs is not None:
            for j in range(i * top_n, (i + 1) * top_n):
                top[_token_repr(ev.top_ids[j])] = float(ev.top_logprobs[j])
        acc["top_logprobs"].append(top)
    return offset


def response_body(chat: bool, model: str, text: str, fin: Finish, logprobs: Any,
                  tool_calls: list[dict[str, Any]] | None = None) -> bytes:
    """A whole (non-streamed) chat.completion / text_completion body; ``logprobs`` None when not asked for;
    ``tool_calls`` (chat with tools): the calls read out of the text, which is then the content around them.
    (Once per non-streaming request: new_id, finish_reason and usage_dict are written out inline.)"""
    reason = _REASONS.get(fin.reason, "stop")
    p, n = fin.prompt_tokens, fin.completion_tokens
    usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
             "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}
    if chat:
        body: dict[str, Any] = {
            "id": f"chatcmpl-{_PREFIX}{next(_counter):x}", "object": "chat.completion", "created": int(clock.wall()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": logprobs, "finish_reason": reason}],
            "usage": usage, "system_fingerprint": None,
        }
        if tool_calls is not None:
            choice = body["choices"][0]
            choice["message"]["content"] = text if text.strip() or not tool_calls else None
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
                if fin.reason == FinishReason.STOP:
                    choice["finish_reason"] = "tool_calls"
    else:
        body = {
            "id": f"cmpl-{_PREFIX}{next(_counter):x}", "object": "text_completion", "created": int(clock.wall()),
            "model": model, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}],
            "usage": usage,
        }
    return orjson.dumps(body)


class ChunkTemplate:
    """Pre-rendered pieces of one stream's ``chat.completion.chunk`` / ``text_completion`` events."""

    __slots__ = ("chat", "head", "tail", "usage_null", "rid", "created", "model_json", "started")

    def __init__(self, chat: bool, rid: str, model: str, include_usage: bool, index: int = 0,
                 created: int = 0) -> None:
        """``index``: the choice these chunks are of (n > 1: gateway.api.fanout; their ``rid`` and
        ``created`` shared)."""
        self.chat = chat
        self.started = False  # set once the response headers are on their way
        self.rid = rid
        self.created = created or int(clock.wall())
        self.model_json = orjson.dumps(model)
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self.usage_null = b',"usage":null' if include_usage else b""
        fp = b',"system_fingerprint":null' if chat else b""
        choice = b',"choices":[{"index":0,"delta":{"content":' if chat else b',"choices":[{"index":0,"text":'
        if index:
            choice = choice.replace(b'"index":0', b'"index":%d' % index)
        self.head = (b'data: {"id":"' + rid.encode() + b'","object":"' + obj + b'","created":'
                     + str(self.created).encode() + b',"model":' + self.model_json + fp + choice)
        self.tail = (b'},"logprobs":null,"finish_reason":null}]' if chat
                     else b',"logprobs":null,"finish_reason":null}]') + self.usage_null + b"}\n\n"

    def role(self) -> bytes:
        """Chat streams open with an empty assistant delta, as OpenAI's do."""
        return (self.head[: -len(b'{"content":')] + b'{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]' + self.usage_null + b"}\n\n")

    def content(self, text: str) -> bytes:
        return self.head + orjson.dumps(text) + self.tail

    def delta(self, delta: dict[str, Any]) -> bytes:
        """A chat chunk whose delta is ``delta`` (tool calls: gateway.api.tool_writers)."""
        return (self.head[: -len(b'{"content":')] + orjson.dumps(delta) + b',"logprobs":null,"finish_reason":null}]'
                + self.usage_null + b"}\n\n")

    def content_with_logprobs(self, text: str, logprobs: Any) -> bytes:
        lp = orjson.dumps({"content": logprobs} if self.chat else logprobs)
        close = b"}" if self.chat else b""
        return (self.head + orjson.dumps(text) + close + b',"logprobs":' + lp + b',"finish_reason":null}]'
                + self.usage_null + b"}\n\n")

    def finish(self, reason: str) -> bytes:
        if self.chat:
            start = self.head[: -len(b'{"content":')] + b'{},"logprobs":null,"finish_reason":"'
        else:
            start = self.head + b'"","logprobs":null,"finish_reason":"'
        return start + reason.encode() + b'"}]' + self.usage_null + b"}\n\n"

    def usage(self, fin: Finish) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.rid, "object": obj, "created": self.created, "model": orjson.loads(self.model_json),
                "choices": [], "usage": usage_dict(fin)}
        if self.chat:
            body["system_fingerprint"] = None
        return b"data: " + orjson.dumps(body) + b"\n\n"
