"""Tool calling (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``): what the gateway adds
to a chat request, and how it reads tool calls back out of the model's text.

The format is the one most open chat templates teach (Hermes, Qwen): the template renders the tool
definitions (its ``tools`` argument, in the worker), and the model answers a call as
``<tool_call>{"name": "<name>", "arguments": <JSON object>}</tool_call>``, several in a row when
parallel calls are allowed. ``tool_choice``:

- ``none``: the tools are still rendered (the model knows them) and its text is plain content;
- ``auto``: free text; whatever ``<tool_call>`` blocks it writes become ``tool_calls``;
- ``required`` / a named function: the output is *constrained* to calls (a Lark grammar with each
  tool's parameters embedded as a JSON Schema, compiled and enforced in the worker like any
  structured output), so it is one or more valid calls by construction.

:class:`ToolCallParser` reads the text as it streams: content outside blocks goes out as content,
a call's name as soon as it is known and its arguments as they arrive (OpenAI's
``function.arguments`` deltas), holding back only what might be the call's closing; the whole
(non-streamed) response runs the same parser over the whole text, so a streamed call reassembled
equals the unstreamed one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import APIError

__all__ = ["ToolSetup", "ToolCall", "ToolCallParser", "parse_tools", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_CLOSE = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE))
_OBJECT = {"type": "object"}
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """A chat request's tools, as the worker and the writers need them."""

    tools_json: str  # the definitions, for the chat template
    guide: str  # a Lark grammar forcing calls ("" : tool_choice auto or none, unconstrained)
    parse: bool  # read tool calls out of the text (False: tool_choice none)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def parse_tools(d: dict[str, Any]) -> ToolSetup | None:
    """The request's tool settings (after its schema check), or None without tools."""
    tools = d.get("tools") or []
    choice: Any = d.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("Tool names must be unique.", "tools")
    for i, name in enumerate(names):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise _bad(f"tools[{i}].function.name must be letters, digits, '_' or '-' (at most 64).",
                       f"tools[{i}].function.name")
    tools_json = orjson.dumps(tools).decode()
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolSetup(tools_json, "", False)
    if choice == "auto":
        return ToolSetup(tools_json, "", True)
    if choice == "required":
        forced = tools
    else:
        name = choice["function"]["name"]
        forced = [t for t in tools if t["function"]["name"] == name]
        if not forced:
            raise _bad(f"tool_choice names the function {name!r}, which is not in 'tools'.", "tool_choice")
    parallel = d.get("parallel_tool_calls") is not False and choice == "required"
    return ToolSetup(tools_json, call_grammar(forced, parallel), True)


def call_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are calls of ``tools``: one, or with
    ``parallel`` one or more, each ``<tool_call>{"name": ..., "arguments": <its parameters>}</tool_call>``."""
    lines = ["start: call+" if parallel else "start: call",
             "call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        fn = t["function"]
        # Compact JSON, as the JSON Schema kinds are (inference/grammar.py): a weak model would spin in free whitespace.
        params = {**(fn.get("parameters") or _OBJECT), "x-guidance": _JSON_STYLE}
        head = CALL_OPEN + '{"name": ' + orjson.dumps(fn["name"]).decode() + ', "arguments": '
        lines.append(f"c{i}: {_lark_str(head)} a{i} {_lark_str('}' + CALL_CLOSE)}")
        lines.append(f"a{i}: %json " + orjson.dumps(params).decode())
    return "\n".join(lines)


def _lark_str(s: str) -> str:
    return orjson.dumps(s).decode()


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCallParser:
    """Splits the model's text into content and tool calls, incrementally (see the module doc).

    :meth:`feed` returns events: ``("content", text)``, ``("call", index, id, name)`` (a call
    begins), ``("args", index, text)`` (more of its arguments)."""

    calls: list[ToolCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _head: bool = False  # the current call's name is known (its arguments are streaming)
    _sent: int = 0  # of the current call's arguments, characters already given out

    def feed(self, text: str, final: bool = False) -> list[tuple[Any, ...]]:
        self._buf += text
        out: list[tuple[Any, ...]] = []
        while True:
            if not self._in_call:
                i = self._buf.find(CALL_OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, CALL_OPEN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(CALL_OPEN):]
                self._in_call, self._head, self._sent = True, False, 0
            if not self._head:
                m = _HEAD.match(self._buf)
                if m is None:
                    end = self._buf.find(CALL_CLOSE)
                    if end >= 0 or not _could_head(self._buf):  # not a call after all: content
                        stop = len(self._buf) if end < 0 else end + len(CALL_CLOSE)
                        self._content(CALL_OPEN + self._buf[:stop], out)
                        self._buf, self._in_call = self._buf[stop:], False
                        continue
                    if final:  # a call cut short before its name was whole ("length"): no call, no markup
                        self._buf, self._in_call = "", False
                    return out
                call = ToolCall(new_call_id(), orjson.loads(f'"{m.group(1)}"'))
                self.calls.append(call)
                out.append(("call", len(self.calls) - 1, call.id, call.name))
                self._buf, self._head = self._buf[m.end():], True
            m = _CLOSE.search(self._buf, self._sent)
            if m is not None:
                self._args(self._buf[self._sent: m.start()], out)
                self._buf, self._in_call = self._buf[m.end():], False
                continue
            keep = 0 if final else _closing_suffix(self._buf)
            self._args(self._buf[self._sent: len(self._buf) - keep], out)
            self._sent = len(self._buf) - keep
            return out  # (at the end, a call cut short keeps the arguments it had)

    def _content(self, text: str, out: list[tuple[Any, ...]]) -> None:
        if text:
            self.content.append(text)
            out.append(("content", text))

    def _args(self, text: str, out: list[tuple[Any, ...]]) -> None:
        if text:
            self.calls[-1].arguments += text
            out.append(("args", len(self.calls) - 1, text))


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``token`` (held back: it may be one)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _could_head(buf: str) -> bool:
    """Whether ``buf`` could still grow into a call's head (``{"name": "...", "arguments": ``)."""
    s = buf.lstrip()
    return len(s) < 256 and (not s or s[0] == "{")


def _closing_suffix(buf: str) -> int:
    """Length of the suffix of ``buf`` that might be the start of a call's closing ``} </tool_call>``."""
    start = max(0, len(buf) - 64)
    for i in range(start, len(buf)):
        rest = buf[i:]
        if not rest[0].isspace() and rest[0] != "}":
            continue
        s = rest.lstrip()
        if not s:
            return len(rest)
        if s[0] == "}" and CALL_CLOSE.startswith(s[1:].lstrip()):
            return len(rest)
    return 0
