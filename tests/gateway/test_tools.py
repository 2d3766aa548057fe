"""Tool calls read out of the model's text (gateway.api.tools) and written as OpenAI writes them
(gateway.api.writers' tool writers): any split of the text gives the calls the whole text gives."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api.params import parse_chat
from gateway.api.tools import ToolCallParser, call_grammar
from gateway.api.writers import ToolJsonWriter, ToolSseWriter, writer_for
from transport.messages import Finish, FinishReason

LIMITS = {"default_max_tokens": 16, "max_tokens_limit": 4096}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEXT = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": [1, {"x": 2}]}}'
        '</tool_call>\n<tool_call> {"name":"get_time","arguments":{}} </tool_call> done <tool_call>junk</tool_call> <tool_')


def whole(text: str) -> ToolCallParser:
    p = ToolCallParser()
    p.feed(text, final=True)
    return p


def test_calls_and_the_content_around_them() -> None:
    p = whole(TEXT)
    assert [(c.name, c.arguments) for c in p.calls] == [
        ("get_weather", '{"city": "Pa}ris", "n": [1, {"x": 2}]}'), ("get_time", "{}")]
    assert "".join(p.content) == "Let me look. \n done <tool_call>junk</tool_call> <tool_"
    assert len({c.id for c in p.calls}) == 2 and all(c.id.startswith("call_") for c in p.calls)


@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_split_streams_what_the_whole_text_gives(cuts: list[int]) -> None:
    p = ToolCallParser()
    events = []
    prev = 0
    for cut in [*sorted(cuts), len(TEXT)]:
        events += p.feed(TEXT[prev:cut])
        prev = cut
    events += p.feed("", final=True)
    ref = whole(TEXT)
    assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in ref.calls]
    args: dict[int, str] = {}
    for ev in events:
        if ev[0] == "args":
            args[ev[1]] = args.get(ev[1], "") + ev[2]
    assert [args[i] for i in range(len(ref.calls))] == [c.arguments for c in ref.calls]
    assert "".join(ev[1] for ev in events if ev[0] == "content") == "".join(ref.content)


@pytest.mark.parametrize("cut", ['<tool_call>{"name": "get_wea', "<tool_call>", '<tool_call> {"na'])
def test_a_call_cut_short_before_its_name_is_neither_call_nor_content(cut: str) -> None:
    """A length cut inside a call's head (finish_reason "length") gives no markup as content,
    whole or streamed (the streamed text held it back, so both drop it)."""
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>' + cut
    p = whole(text)
    assert [c.name for c in p.calls] == ["get_time"] and "".join(p.content) == "Sure. "
    s = ToolCallParser()
    events = [*s.feed(text[:30]), *s.feed(text[30:]), *s.feed("", final=True)]
    assert "".join(ev[1] for ev in events if ev[0] == "content") == "Sure. "


def _request(**kw: object) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **kw})


def test_tool_choice_shapes_the_request() -> None:
    auto = parse_chat(_request(), **LIMITS)
    assert auto.tools is not None and not auto.params.guide_kind and json.loads(auto.params.tools) == [TOOL]
    assert isinstance(writer_for(auto), ToolJsonWriter)
    none = parse_chat(_request(tool_choice="none", stream=True), **LIMITS)
    assert none.tools is None and none.params.tools and type(writer_for(none)).__name__ == "SseWriter"
    req = parse_chat(_request(tool_choice="required", stream=True), **LIMITS)
    assert req.params.guide_kind == "lark" and "start: call+" in req.params.guide
    assert isinstance(writer_for(req), ToolSseWriter)
    one = parse_chat(_request(tool_choice="required", parallel_tool_calls=False), **LIMITS)
    assert "start: call\n" in one.params.guide
    plain = parse_chat(orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}), **LIMITS)
    assert plain.tools is None and not plain.params.extended


def test_the_call_grammar_compiles_and_admits_exactly_calls() -> None:
    pytest.importorskip("llguidance")
    from inference.grammar import GrammarCompiler
    from inference.tokenizer import ByteTokenizer

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>'
    for parallel, text, ok in ((False, call, True), (True, call * 2, True), (False, call * 2, False),
                               (False, call.replace("get_weather", "other"), False)):
        guide = GrammarCompiler(ByteTokenizer()).guide("lark", call_grammar([TOOL], parallel))
        consumed = all(guide.consume(b) for b in text.encode())
        assert (consumed and guide.accepting) is ok, text


def _fin(reason: FinishReason = FinishReason.STOP) -> Finish:
    return Finish(1, reason, 3, 20)


def test_streamed_chunks_reassemble_to_the_whole_response() -> None:
    g = parse_chat(_request(stream=True), **LIMITS)
    sse = ToolSseWriter(g)
    out = sse.opening() + b"".join(sse.text(TEXT[i:i + 7].encode()) for i in range(0, len(TEXT), 7))
    out += sse.finish(_fin())
    calls: dict[int, dict[str, str]] = {}
    content = ""
    reasons = []
    for line in out.decode().split("\n\n"):
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        reasons.append(choice["finish_reason"])
        content += choice["delta"].get("content") or ""
        for tc in choice["delta"].get("tool_calls", []):
            acc = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            acc["name"] += tc.get("function", {}).get("name", "")
            acc["arguments"] += tc.get("function", {}).get("arguments", "")
    body = json.loads(ToolJsonWriter(parse_chat(_request(), **LIMITS)).whole(TEXT.encode(), _fin()))
    msg = body["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert msg["content"] == content and reasons[-1] == body["choices"][0]["finish_reason"] == "tool_calls"
    cut = json.loads(ToolJsonWriter(g).whole(TEXT.encode(), _fin(FinishReason.LENGTH)))
    assert cut["choices"][0]["finish_reason"] == "length"
